"""The prefixd identities of an SGLang HiCache backend: SGLang's storage config and host pool, plus
what only the operator knows (the extra config).

SGLang's page hashes chain the token ids (and a request's LoRA id and extra key) and nothing else,
so engines with other weights, tokenizer, template or KV layout would share pages. Each field:

  model       HiCacheStorageConfig.model_name, or the extra config's "model"
  weights     "weights" (a revision or fingerprint), or a local model directory's fingerprint;
              the backend refuses to start without one
  tokenizer   "tokenizer" (default: the model and its weights)
  template    "template" (default "none"); rope: "rope" (default "default"); adapter: "adapter"
  mm          a local model directory's multimodal preprocessing files (their fingerprint)
  kv_layout   the pool's name, and what the host pool says of a page (its class, dtype, layout,
              page size, layers, heads, head size, bytes per token; a Mamba pool's every
              state's dtype and shape) and the parallel ranks; an MLA model's pools but
              Mamba's (KV, indexer, sliding-window, draft), which SGLang backs up on its writer
              rank alone, leave the tp rank out so that every rank reads what the writer stored
  tenant      "tenant" (default "default")

A page of a parallel engine is one part per rank that splits the KV (tp ranks, unless the pool
is replicated: any of an MLA model's but Mamba's; pipeline stages; attention context-parallel
ranks; DCP shards), each under its own identity: `paged_parts` and `trailing_parts` are those of
every part (this rank's first), and the backend reports a page only while every part is stored.
The dp rank names another replica, not a part.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefixd.errors import ConfigError
from prefixd.integrations.identity import identity_of, local_preprocessing, local_weights
from prefixd.schema.identity import Identity
from prefixd.schema.state import StateGroup

KEY_BYTES = 32  # an SGLang page hash: SHA-256, 64 hex characters
WORDS_PER_KEY = KEY_BYTES // 4
KV = "kv"
MAMBA = "mamba"  # SGLang's PoolName.MAMBA: tp-sharded state, on an MLA model too


def operator_fields(storage_config: Any) -> dict[str, str | None]:
    """The identity fields that do not depend on the host pool; ConfigError without weights."""
    extra: Mapping[str, Any] = storage_config.extra_config or {}
    model = extra.get("model") or storage_config.model_name
    if not model:
        raise ConfigError("prefixd sglang backend: no model name (set extra config 'model')")
    model = str(model)
    weights = extra.get("weights")
    local = Path(model) if Path(model).is_dir() else None
    if not weights and local is not None:
        weights = local_weights(local)
    if not weights:
        raise ConfigError(
            "prefixd sglang backend: refusing to start without a weights identity: set extra "
            "config 'weights' (a revision or a fingerprint of the weight files)"
        )
    return {
        "model": model,
        "weights": str(weights),
        "tokenizer": str(extra.get("tokenizer") or f"{model}@{weights}"),
        "template": str(extra.get("template") or "none"),
        "rope": str(extra.get("rope") or "default"),
        "adapter": None if extra.get("adapter") is None else str(extra["adapter"]),
        "mm": None if local is None else local_preprocessing(local),
        "tenant": str(extra.get("tenant") or "default"),
    }


def _pool_layout(host_pool: Any) -> dict[str, Any]:
    """What a host pool says about the bytes of one of its pages."""
    layout = {
        "class": type(host_pool).__name__,
        "dtype": str(getattr(host_pool, "dtype", None)).removeprefix("torch."),
        "layout": getattr(host_pool, "layout", None),
        "page_size": getattr(host_pool, "page_size", None),
        "layers": getattr(host_pool, "layer_num", None),
        "heads": getattr(host_pool, "head_num", None),
        "head_dim": getattr(host_pool, "head_dim", None),
        "page_bytes": int(host_pool.get_dummy_flat_data_page().nbytes),
    }
    size_per_token = getattr(host_pool, "size_per_token", None)
    if size_per_token is not None:
        layout["token_bytes"] = int(size_per_token)
    states = _state_layout(host_pool)
    if states is not None:
        layout["states"] = states
    return layout


def _state_layout(host_pool: Any) -> dict[str, Any] | None:
    """A Mamba host pool's page is its SSM (temporal) and conv states of every Mamba layer, then
    any side states: each one's dtype and shape. Its `dtype` is the conv states' alone and its page
    size a sum, so an SSM state of another dtype (or shape) would otherwise share entries; None for
    a pool of another kind."""
    shape = getattr(host_pool, "temporal_state_shape", None)
    if shape is None:
        return None
    return {
        "layers": int(host_pool.num_mamba_layers),
        "temporal": [str(host_pool.temporal_dtype), list(shape)],
        "conv": [str(host_pool.conv_dtype), [list(s) for s in host_pool.conv_state_shapes]],
        "side": [[str(b.dtype), list(b.shape[1:])] for b in host_pool.slot_state_buffers],
    }


Part = tuple[int, int, int, int]  # the (tp, pp, cp, dcp) ranks of one part of a page


def _ranks(storage_config: Any, part: Part, *, replicated: bool) -> dict[str, Any]:
    """The storage config's parallel layout, of `part`'s ranks; a replicated (MLA) pool leaves the
    tp rank out."""
    c = storage_config
    tp, pp, cp, dcp = part
    return {
        "tp_rank": None if replicated else tp,
        "tp_size": c.tp_size,
        "pp": [pp, c.pp_size],
        "cp": [cp, c.attn_cp_size],
        "dcp": [dcp, c.dcp_size],
        "dp_rank": c.dp_rank,
        "replicated": replicated,
    }


def parts(storage_config: Any, *, replicated: bool) -> list[Part]:
    """The ranks of every part of a page, this rank's first: every pipeline stage, context-
    parallel rank and tp rank (with its DCP shard, tp rank mod DCP size, as SGLang groups them),
    or for a replicated pool every DCP shard in place of the tp ranks."""
    c = storage_config
    own = (c.tp_rank, c.pp_rank, c.attn_cp_rank, c.dcp_rank)
    stages = [(pp, cp) for pp in range(c.pp_size) for cp in range(c.attn_cp_size)]
    if replicated:
        found = [(c.tp_rank, pp, cp, dcp) for pp, cp in stages for dcp in range(c.dcp_size)]
    else:
        found = [(tp, pp, cp, tp % c.dcp_size) for pp, cp in stages for tp in range(c.tp_size)]
    return [own, *(part for part in found if part != own)]


def is_replicated(storage_config: Any, name: str) -> bool:
    """Whether pool `name` is one part for every tp rank: SGLang backs up every pool of an MLA
    model on its storage writer alone (`is_storage_writer`, one per DCP shard), except the
    tp-sharded Mamba state, which every rank writes (`HybridCacheController.should_backup`)."""
    return bool(storage_config.is_mla_model) and name != MAMBA


def paged_parts(
    fields: Mapping[str, str | None], storage_config: Any, name: str, host_pool: Any
) -> tuple[Identity, ...]:
    """The engine-keyed identities of one paged pool (the KV pool, or another pool needed for
    every page), one per part of a page, this rank's first: one SGLang page per block, chained in
    prefix order. The pool's name tells apart two pools of one class and shape, whose pages have
    the same hashes."""
    return _per_part(
        fields,
        storage_config,
        ({"pool": name}, _pool_layout(host_pool)),
        replicated=is_replicated(storage_config, name),
        block_tokens=int(host_pool.page_size),
        key_bytes=KEY_BYTES,
    )


def trailing_parts(
    fields: Mapping[str, str | None], storage_config: Any, pools: Mapping[str, Any]
) -> dict[str, tuple[Identity, ...]]:
    """Each trailing pool's identities, one per part, this rank's first: a checkpoint group per
    pool on the chain of page hashes. Pools written by different ranks (an MLA model's Mamba
    state and sliding window) are two identities, so that each is found where SGLang wrote it.
    prefixd refuses a state spec on an engine-keyed identity, so a page hash takes a block's
    place as its 8 little-endian words (block_tokens 8), compared on every hit as engine keys
    are. Such a chain cannot name a page's multimodal items, so `mm` is part of the layout."""
    found: dict[str, tuple[Identity, ...]] = {}
    for shared in (False, True):
        group = {n: p for n, p in pools.items() if is_replicated(storage_config, n) == shared}
        if group:
            ids = _trailing_group(fields, storage_config, group, replicated=shared)
            found.update(dict.fromkeys(group, ids))
    return found


def _trailing_group(
    fields: Mapping[str, str | None],
    storage_config: Any,
    pools: Mapping[str, Any],
    *,
    replicated: bool,
) -> tuple[Identity, ...]:
    """The parts of one hybrid identity of `pools`, all written by the same ranks."""
    layout: dict[str, Any] = {
        "pools": {name: _pool_layout(pool) for name, pool in sorted(pools.items())},
        "page_hash_words": WORDS_PER_KEY,
    }
    if fields.get("mm") is not None:
        layout["mm"] = fields["mm"]
    return _per_part(
        {**fields, "mm": None},
        storage_config,
        (layout,),
        replicated=replicated,
        block_tokens=WORDS_PER_KEY,
        state=tuple(StateGroup.checkpoint(name, policy="chosen") for name in sorted(pools)),
    )


def _per_part(
    fields: Mapping[str, str | None],
    storage_config: Any,
    layouts: tuple[Mapping[str, Any], ...],
    *,
    replicated: bool,
    **given: Any,
) -> tuple[Identity, ...]:
    """The identity of `layouts` and each part's ranks, for every part, this rank's first."""
    return tuple(
        identity_of(
            fields,
            kv_layout="sglang-hicache "
            + _joined(*layouts, _ranks(storage_config, part, replicated=replicated)),
            tenant=str(fields["tenant"]),
            **given,
        )
        for part in parts(storage_config, replicated=replicated)
    )


def _joined(*layouts: Mapping[str, Any]) -> str:
    """The layouts as one canonical JSON object. A key in two of them is refused: the later one
    would silently replace the other's value (a pool's name once lost so), and two layouts that
    differ there would share an identity."""
    joined: dict[str, Any] = {}
    for layout in layouts:
        if clash := joined.keys() & layout.keys():
            raise ValueError(f"prefixd sglang identity: layout keys given twice: {sorted(clash)}")
        joined.update(layout)
    return json.dumps(joined, sort_keys=True, separators=(",", ":"))


__all__ = [
    "KEY_BYTES",
    "KV",
    "WORDS_PER_KEY",
    "is_replicated",
    "operator_fields",
    "paged_parts",
    "parts",
    "trailing_parts",
]
