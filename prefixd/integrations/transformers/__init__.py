"""Save the prefix state of a `transformers` cache as prefixd state-group payloads, and restore it.

Each layer of a `DynamicCache` is mapped by what it is (layout.py), never by the model's name, onto
the groups of `prefixd.schema.state` (fields.py; the README's table lists them). Nothing is
pickled: a paged group's page is its blocks' rows, bare bytes whose shapes follow from the config;
a checkpoint payload describes its tensors in a header, since each mixer sizes its states its own
way. Restore builds the cache layers directly, not through `update()`: a sliding layer rebuilt
that way keeps the wrong keys (DeepSeek-V4 then gives wrong logits with no error), and a
linear-attention layer needs `has_previous_state` set. A window, recurrent or compressor state
exists only at the cache's end: for an earlier boundary, `capture_checkpoint` during the prefill.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

try:
    import torch
    from transformers import DynamicCache, PreTrainedConfig
except ModuleNotFoundError as missing:  # the base install serves without either: an extra
    if missing.name not in ("torch", "transformers"):
        raise
    raise ModuleNotFoundError(
        f"prefixd.integrations.transformers needs {missing.name}, which the base install leaves"
        " out: pip install 'prefixd[transformers]'",
        name=missing.name,
    ) from missing
from transformers.cache_utils import Cache, LinearAttentionCacheLayerMixin

from prefixd.errors import LayoutError
from prefixd.schema.state import PAGED, StateGroup, StateSpec, check_spec

from .fields import GROUP_ORDER, KINDS, RECURRENT, Buffer, Field, pack_described
from .layout import StateLayout, Tensors, check_positive, fresh_cache, layout_of, state_layout
from .prompts import prompt_of

__all__ = [
    "GROUP_ORDER",
    "Field",
    "LayoutError",
    "StateLayout",
    "StatePayloads",
    "capture_checkpoint",
    "export_state",
    "prompt_of",
    "restore_state",
    "state_layout",
    "state_spec",
]


@dataclass
class StatePayloads:
    """What `export_state` returns: pages per paged group, payloads by boundary (in tokens) per
    checkpoint group."""

    paged: dict[str, list[bytes]] = field(default_factory=dict)
    checkpoints: dict[str, dict[int, bytes]] = field(default_factory=dict)


def state_spec(
    config: PreTrainedConfig,
    *,
    block_tokens: int,
    page_blocks: int = 1,
    window_policy: str = "chosen",
    recurrent_policy: str | None = None,
    period_tokens: int = 0,
) -> StateSpec:
    """The identity's state groups for `config`: only the groups the model has, in GROUP_ORDER.
    `window_policy` covers the windows and the V4 compressor state, needed at the same boundaries;
    `recurrent_policy` (default: the same) the linear-attention states."""
    layout = state_layout(config, block_tokens=block_tokens)
    recurrent_policy = window_policy if recurrent_policy is None else recurrent_policy
    groups = []
    for name in layout.groups:
        if KINDS[name] == PAGED:
            groups.append(StateGroup.paged(name, page_blocks=page_blocks))
            continue
        policy = recurrent_policy if name == RECURRENT else window_policy
        if policy == "none":
            raise LayoutError(
                f"group {name!r}: policy 'none' needs a replay from an earlier checkpoint,"
                " which restore_state does not do; use 'chosen', 'full' or 'periodic'"
            )
        period = period_tokens if policy == "periodic" else 0
        groups.append(StateGroup.checkpoint(name, policy=policy, period_tokens=period))
    spec = tuple(groups)
    check_spec(spec, block_tokens)
    return spec


def export_state(
    config: PreTrainedConfig,
    cache: Cache,
    *,
    n_tokens: int,
    block_tokens: int,
    page_blocks: int = 1,
    first_block: int = 0,
    dtype: torch.dtype | None = None,
    row: int = 0,
    checkpoints: bool = True,
) -> StatePayloads:
    """The payloads of the prefix of `n_tokens` tokens held in batch row `row` of `cache`: the
    pages a store put of blocks [first_block, n_tokens // block_tokens) carries (like the store,
    refused if the last is still open), and with `checkpoints` the checkpoint groups, which exist
    only at the cache's end. `dtype` is the model dtype, read from the cache when None."""
    _check_boundary("n_tokens", n_tokens, block_tokens)
    check_positive("page_blocks", page_blocks)
    _check_row(row)
    n_blocks = n_tokens // block_tokens
    if isinstance(first_block, bool) or not isinstance(first_block, int):
        raise LayoutError(f"first_block must be an int, got {type(first_block).__name__}")
    if not 0 <= first_block <= n_blocks:
        raise LayoutError(f"first_block {first_block} is outside 0..{n_blocks}")
    if n_blocks > first_block and n_blocks % page_blocks:
        start = n_blocks - n_blocks % page_blocks
        raise LayoutError(
            f"the page of blocks {start}..{start + page_blocks - 1} is not closed at block"
            f" {n_blocks}: export at a multiple of {page_blocks * block_tokens} tokens"
            " (only closed pages are stored)"
        )
    _check_cache(cache)
    layout = state_layout(config, block_tokens=block_tokens, dtype=dtype or _cache_dtype(cache))
    paged, by_group = layout.read(cache, n_tokens, row=row, checkpoints=checkpoints)
    payloads = StatePayloads()
    for group in layout.paged_groups:
        payloads.paged[group] = _pages(layout, group, paged, first_block, n_blocks, page_blocks)
    for group in layout.checkpoint_groups if checkpoints else ():
        payloads.checkpoints[group] = {n_tokens: pack_described(by_group[group])}
    return payloads


def capture_checkpoint(
    config: PreTrainedConfig,
    cache: Cache,
    n_tokens: int,
    *,
    block_tokens: int | None = None,
    dtype: torch.dtype | None = None,
    row: int = 0,
) -> dict[str, bytes]:
    """The checkpoint payloads of `cache` now, at `n_tokens` tokens, e.g. between prefill chunks
    (a window or recurrent state can be read only where it was reached)."""
    if block_tokens is None:
        block_tokens = _smallest_block(config)
        check_positive("n_tokens", n_tokens)
    else:
        _check_boundary("n_tokens", n_tokens, block_tokens)
    _check_row(row)
    _check_cache(cache)
    layout = state_layout(config, block_tokens=block_tokens, dtype=dtype or _cache_dtype(cache))
    _, by_group = layout.read(cache, n_tokens, row=row)
    return {group: pack_described(tensors) for group, tensors in by_group.items()}


def restore_state(
    config: PreTrainedConfig,
    *,
    reusable_tokens: int,
    block_tokens: int,
    page_blocks: int = 1,
    paged: Mapping[str, Iterable[Buffer]],
    checkpoints: Mapping[str, Buffer],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> DynamicCache:
    """A fresh `DynamicCache` (batch 1) holding exactly the state of the first `reusable_tokens`,
    from the pages covering them and the checkpoints at that boundary (any contiguous buffers:
    the tensors are fresh copies). Feed the next tokens `position_ids` from `reusable_tokens`."""
    check_positive("page_blocks", page_blocks)
    if reusable_tokens != 0:
        _check_boundary("reusable_tokens", reusable_tokens, block_tokens)
    cache = fresh_cache(config)
    layout = layout_of(config, cache, block_tokens=block_tokens, dtype=dtype)
    if reusable_tokens == 0:
        return cache
    _check_groups("paged", paged, layout.paged_groups)
    _check_groups("checkpoints", checkpoints, layout.checkpoint_groups)
    tensors: dict[tuple[int, str], torch.Tensor] = {}
    for group in layout.paged_groups:
        tensors.update(layout.unpack_pages(group, paged[group], reusable_tokens, page_blocks))
    for group in layout.checkpoint_groups:
        tensors.update(layout.unpack_checkpoint(group, checkpoints[group], reusable_tokens))
    layout.write(cache, tensors, reusable_tokens, device)
    return cache


# --- helpers -----------------------------------------------------------------------------------


def _pages(
    layout: StateLayout,
    group: str,
    tensors: Tensors,
    first_block: int,
    n_blocks: int,
    page_blocks: int,
) -> list[bytes]:
    start = first_block // page_blocks * page_blocks  # the pages ending in the put's blocks
    if start >= n_blocks:
        return []
    records = layout.block_records(group, tensors, start, n_blocks)
    return [
        records[offset : offset + page_blocks].numpy().tobytes()
        for offset in range(0, n_blocks - start, page_blocks)
    ]


def _smallest_block(config: PreTrainedConfig) -> int:
    """The smallest block size the layout accepts: the lcm of the compression rates, else 1."""
    text = config.get_text_config(decoder=True)
    rates = [1, *(getattr(text, "compress_rates", None) or {}).values()]
    return int(np.lcm.reduce(rates))


def _check_boundary(name: str, n_tokens: object, block_tokens: object) -> None:
    block = check_positive("block_tokens", block_tokens)
    if check_positive(name, n_tokens) % block:
        raise LayoutError(
            f"{name} {n_tokens} is not a multiple of block_tokens {block_tokens}: state is"
            " stored at block boundaries only (an open tail is never stored)"
        )


def _check_row(row: object) -> None:
    if isinstance(row, bool) or not isinstance(row, int) or row < 0:
        raise LayoutError(f"row must be a batch index (an int >= 0), got {row!r}")


def _check_groups(what: str, given: Mapping[str, object], expected: tuple[str, ...]) -> None:
    if not isinstance(given, Mapping):
        raise LayoutError(f"{what} must map group names to payloads")
    missing = [g for g in expected if g not in given]
    unknown = sorted(set(given) - set(expected))
    if missing or unknown:
        raise LayoutError(
            f"{what}: the model needs groups {list(expected)}; missing {missing}, unknown {unknown}"
        )


def _check_cache(cache: object) -> None:
    """A family's own cache class (a subclass too) keeps its state in ways it alone knows."""
    if type(cache) is not DynamicCache:
        raise LayoutError(
            f"{type(cache).__name__} is not a transformers DynamicCache: this family keeps its"
            " state in a cache of its own, which is not stored"
        )


def _cache_dtype(cache: Cache) -> torch.dtype:
    for layer in cache.layers:
        keys = getattr(layer, "keys", None)
        if isinstance(keys, torch.Tensor) and keys.numel():
            return keys.dtype
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for conv in layer.conv_states.values():
                if conv is not None:
                    return conv.dtype
    raise LayoutError(
        "the cache holds no state: run the prefill first (a family that keeps its state outside"
        " its transformers cache, or none, cannot be stored)"
    )
