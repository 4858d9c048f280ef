"""Save the prefix state of a `transformers` cache as prefixd state-group payloads, and restore it.

After a prefill, a `transformers` `DynamicCache` holds one layer object per decoder layer. This
package maps each layer by what it is (see `layout`), not by the model's name, onto the groups of
`prefixd.schema.state` (see `state_spec`):

  kv          paged       full-attention keys and values, one row per token
  mla         paged       MLA latents (the compressed KV and the rope key) of layers whose config
                          has `kv_lora_rank`
  compressed  paged       DeepSeek-V4 CSA/HCA compressed entries, one row per closed compressed
                          block
  indexer     paged       DSA indexer keys (one row per token), the position history a model
                          keeps on its first indexed layer (3 int64 a token, -1 where none is
                          kept), and DeepSeek-V4 lightning-indexer keys (one row per closed CSA
                          block)
  window      checkpoint  sliding-window keys/values: exactly the last `sliding_window - 1` tokens
  compressor  checkpoint  DeepSeek-V4 CSA overlap state (the last closed window's Ca slice)
  recurrent   checkpoint  linear-attention conv and recurrent states (Mamba, Mamba-2, Gated
                          DeltaNet, KDA, short convolutions, ...), every state of every such layer

Byte layout. Nothing is pickled. Tensors are stored without their batch dimension (a prefix is one
sequence) in row-major order, each in its own dtype.

* A paged group's page is the concatenation of its `page_blocks` blocks' records. A block's record
  holds, layer by layer and tensor by tensor (keys before values), that block's rows, so the first
  blocks of a page are a byte prefix of it. Row shapes follow from the config and `block_tokens`.
  Like the store, export refuses a page still open.
* A checkpoint payload starts with a header naming each tensor's layer, name (`keys`, `values`,
  `conv.<i>`, `recurrent.<i>`, ...), dtype and shape (`fields.pack_described`), then holds the
  whole tensors at the boundary, layer by layer: each mixer sizes its states from attributes of
  its own, and some families size a window's heads in their code. Restore checks the header
  against the layers the config has.

Restoring builds the cache layers directly instead of replaying them through `update()`: a sliding
layer rebuilt through `update()` keeps the wrong keys and DeepSeek-V4 then gives wrong logits with
no error, and a linear-attention layer needs `has_previous_state` set.

Where state can be read. Paged groups can be exported at any closed boundary up to the cache's
length. A sliding window, a recurrent state and the V4 compressor state exist only at the cache's
end: to store one at an earlier boundary, prefill up to it, `capture_checkpoint`, go on, and export
the pages later with `checkpoints=False`.
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
from .layout import StateLayout, check_positive, fresh_cache, layout_of, state_layout

__all__ = [
    "GROUP_ORDER",
    "Field",
    "LayoutError",
    "StateLayout",
    "StatePayloads",
    "capture_checkpoint",
    "export_state",
    "restore_state",
    "state_layout",
    "state_spec",
]


@dataclass
class StatePayloads:
    """What `export_state` returns: pages per paged group, and payloads per checkpoint group.

    `paged[group]` lists the pages starting in blocks [first_block, n_tokens // block_tokens);
    `checkpoints[group]` maps a boundary (in tokens) to the payload at that boundary.
    """

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

    `window_policy` applies to the sliding windows and the V4 compressor state, which are needed
    at the same boundaries; `recurrent_policy` (default: the same) to linear-attention states.
    Policy "none" is refused: `restore_state` rebuilds a boundary from its checkpoint only.
    """
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
    """The payloads of the prefix of `n_tokens` tokens held in batch row `row` of `cache`.

    Pages are those a store put of blocks [first_block, n_tokens // block_tokens) carries: the
    ones starting in that range; `n_tokens` may be any closed boundary up to the cache's length.
    Like the store, this refuses a range that ends inside a page, as its last page would still be
    open. With `checkpoints`, the checkpoint groups are taken at `n_tokens`, which must then be
    the cache's length: a sliding window or recurrent state exists only there (see
    `capture_checkpoint` for earlier boundaries). `dtype` is the model dtype, inferred from the
    cache when None.
    """
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
    """The checkpoint payloads of `cache` now, at `n_tokens` tokens, e.g. between prefill chunks.

    A sliding window or a recurrent state can only be read at the point it was reached, so an
    engine that wants a checkpoint at an earlier boundary prefills up to it, captures, and goes
    on. `block_tokens`, when given, must divide `n_tokens`.
    """
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
    """A fresh `DynamicCache` (batch 1) holding exactly the state of the first `reusable_tokens`.

    `paged[group]` are the pages covering [0, reusable_tokens) (only the blocks needed are read
    from the last one); `checkpoints[group]` is the payload at boundary `reusable_tokens`. Any
    contiguous byte buffer is accepted, read-only ones too: the tensors are fresh copies. Feed the
    next tokens with explicit `position_ids` starting at `reusable_tokens`.
    """
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
    tensors: Mapping[tuple[int, str], torch.Tensor],
    first_block: int,
    n_blocks: int,
    page_blocks: int,
) -> list[bytes]:
    """The group's pages starting in blocks [first_block, n_blocks), all closed."""
    start = -(-first_block // page_blocks) * page_blocks
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
    """Only a `DynamicCache` is mapped: a family with a cache class of its own (a subclass too)
    keeps its state in ways its class alone knows."""
    if type(cache) is not DynamicCache:
        raise LayoutError(
            f"{type(cache).__name__} is not a transformers DynamicCache: this family keeps its"
            " state in a cache of its own, which is not stored"
        )


def _cache_dtype(cache: Cache) -> torch.dtype:
    """The model dtype, read from the first key or conv state the cache holds."""
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
