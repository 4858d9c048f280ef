"""The prefixd identities of an SGLang HiCache backend: SGLang's storage config and host pool, plus
what only the operator knows (the extra config).

SGLang's page hashes chain the token ids (and a request's LoRA id and extra key) and nothing else,
so engines with other weights, tokenizer, template or KV layout would share pages. Each field:

  model       HiCacheStorageConfig.model_name, or the extra config's "model"
  weights     "weights" (a revision or fingerprint), or a local model directory's fingerprint;
              the backend refuses to start without one
  tokenizer   "tokenizer" (default: the model and its weights)
  template    "template" (default "none"); rope: "rope" (default "default"); adapter: "adapter"
  kv_layout   what the host pool says of a page (dtype, layout, page size, layers, heads, head
              size, bytes per token; a Mamba pool's every state's dtype and shape) and the
              parallel ranks; MLA KV, whole on every tp rank, leaves the tp rank out so that
              every rank reads what the writer rank stored
  tenant      "tenant" (default "default")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefixd.errors import ConfigError
from prefixd.integrations.identity import identity_of, local_weights
from prefixd.schema.identity import Identity
from prefixd.schema.state import StateGroup

KEY_BYTES = 32  # an SGLang page hash: SHA-256, 64 hex characters
WORDS_PER_KEY = KEY_BYTES // 4
KV = "kv"


def operator_fields(storage_config: Any) -> dict[str, str | None]:
    """The identity fields that do not depend on the host pool; ConfigError without weights."""
    extra: Mapping[str, Any] = storage_config.extra_config or {}
    model = extra.get("model") or storage_config.model_name
    if not model:
        raise ConfigError("prefixd sglang backend: no model name (set extra config 'model')")
    model = str(model)
    weights = extra.get("weights")
    if not weights and Path(model).is_dir():
        weights = local_weights(Path(model), indexes=("*.safetensors.index.json",))
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
        "tenant": str(extra.get("tenant") or "default"),
    }


def _pool_layout(host_pool: Any) -> dict[str, Any]:
    """What a host pool says about the bytes of one of its pages."""
    layout = {
        "pool": type(host_pool).__name__,
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


def _ranks(storage_config: Any, *, replicated: bool) -> dict[str, Any]:
    """The storage config's parallel layout; a replicated (MLA) pool leaves the tp rank out."""
    return {
        "tp_rank": None if replicated else storage_config.tp_rank,
        "tp_size": storage_config.tp_size,
        "pp": [storage_config.pp_rank, storage_config.pp_size],
        "cp": [storage_config.attn_cp_rank, storage_config.attn_cp_size],
        "dcp": [storage_config.dcp_rank, storage_config.dcp_size],
        "dp_rank": storage_config.dp_rank,
        "replicated": replicated,
    }


def paged_identity(
    fields: Mapping[str, str | None], storage_config: Any, name: str, host_pool: Any
) -> Identity:
    """The engine-keyed identity of one paged pool (the KV pool, or another pool needed for every
    page): one SGLang page per block, chained in prefix order."""
    replicated = bool(storage_config.is_mla_model) and name == KV
    layout = {
        "pool": name,
        **_pool_layout(host_pool),
        **_ranks(storage_config, replicated=replicated),
    }
    return _identity(fields, layout, block_tokens=int(host_pool.page_size), key_bytes=KEY_BYTES)


def trailing_identity(
    fields: Mapping[str, str | None], storage_config: Any, pools: Mapping[str, Any]
) -> Identity:
    """The trailing pools' identity: a checkpoint group per pool on the chain of page hashes.
    prefixd refuses a state spec on an engine-keyed identity, so a page hash takes a block's place
    as its 8 little-endian words (block_tokens 8), compared on every hit as engine keys are."""
    groups = tuple(StateGroup.checkpoint(name, policy="chosen") for name in sorted(pools))
    layout = {
        "pools": {name: _pool_layout(pool) for name, pool in sorted(pools.items())},
        "page_hash_words": WORDS_PER_KEY,
        **_ranks(storage_config, replicated=False),
    }
    return _identity(fields, layout, block_tokens=WORDS_PER_KEY, state=groups)


def _identity(
    fields: Mapping[str, str | None], layout: Mapping[str, Any], **given: Any
) -> Identity:
    kv_layout = "sglang-hicache " + json.dumps(layout, sort_keys=True, separators=(",", ":"))
    return identity_of(fields, kv_layout=kv_layout, tenant=str(fields["tenant"]), **given)


__all__ = [
    "KEY_BYTES",
    "KV",
    "WORDS_PER_KEY",
    "operator_fields",
    "paged_identity",
    "trailing_identity",
]
