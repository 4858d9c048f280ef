"""The prefixd identities of an SGLang HiCache backend: SGLang's storage config and host pool, plus
what only the operator knows.

SGLang's page hashes chain the page's token ids (and a request's LoRA id and extra key) into a
SHA-256 over the whole prefix, but nothing else: its own file backend keys on the model name and
parallelism only, so two engines with other weights, tokenizer, template or KV layout would share
pages. prefixd's identity carries every one of them; each field's source:

  model       HiCacheStorageConfig.model_name (SGLang's served model, tagged with the host
              pool's page format when it has one), or the extra config's "model"
  weights     the extra config's "weights" (a revision or a fingerprint of the weight files:
              `prefixd.schema.fingerprint.fingerprint_files`), or the fingerprint of a local
              model directory's config.json and weight index; the backend refuses to start
              without one
  tokenizer   the extra config's "tokenizer" (default: the model and its weights)
  template    the extra config's "template" (the chat template's fingerprint; default "none")
  rope        the extra config's "rope" (default "default")
  adapter     the extra config's "adapter" (None: no LoRA adapter)
  kv_layout   what the host pool says (its dtype, layout, page size, layers, heads, head size,
              bytes per token) and the storage config's parallel ranks: tp rank and size, pp,
              attention-cp and dp rank; MLA KV, which every tp rank holds whole, leaves the tp
              rank out so that every rank reads what the writer rank stored
  tenant      the extra config's "tenant" (default "default")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefixd.errors import ConfigError
from prefixd.schema.fingerprint import fingerprint_files
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
        weights = "local:" + _local_fingerprint(Path(model))
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


def _local_fingerprint(local: Path) -> str:
    indexes = sorted(local.glob("*.safetensors.index.json"))
    weights = indexes or sorted(local.glob("*.safetensors")) or sorted(local.glob("*.bin"))
    return fingerprint_files([local / "config.json", *weights])


def pool_layout(host_pool: Any) -> dict[str, Any]:
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
    return layout


def ranks(storage_config: Any, *, replicated: bool) -> dict[str, Any]:
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
        **pool_layout(host_pool),
        **ranks(storage_config, replicated=replicated),
    }
    return _identity(fields, layout, block_tokens=int(host_pool.page_size), key_bytes=KEY_BYTES)


def trailing_identity(
    fields: Mapping[str, str | None], storage_config: Any, pools: Mapping[str, Any]
) -> Identity:
    """The identity of the trailing pools (sliding windows, recurrent states): one checkpoint
    group per pool on the chain of page hashes, so prefixd's joint rule answers the longest
    boundary where every one of them has its state. prefixd refuses a state spec on an
    engine-keyed identity, so a page hash takes a block's place as its 8 little-endian words
    (block_tokens 8); the record stores and compares them on every hit, as it does engine keys."""
    groups = tuple(StateGroup.checkpoint(name, policy="chosen") for name in sorted(pools))
    layout = {
        "pools": {name: pool_layout(pool) for name, pool in sorted(pools.items())},
        "page_hash_words": WORDS_PER_KEY,
        **ranks(storage_config, replicated=False),
    }
    base = _identity(fields, layout, block_tokens=WORDS_PER_KEY, key_bytes=None)
    return replace(base, state=groups)


def _identity(
    fields: Mapping[str, str | None],
    layout: Mapping[str, Any],
    *,
    block_tokens: int,
    key_bytes: int | None,
) -> Identity:
    return Identity(
        model=str(fields["model"]),
        weights=str(fields["weights"]),
        tokenizer=str(fields["tokenizer"]),
        template=str(fields["template"]),
        rope=str(fields["rope"]),
        kv_layout="sglang-hicache " + json.dumps(layout, sort_keys=True, separators=(",", ":")),
        block_tokens=block_tokens,
        tenant=str(fields["tenant"]),
        adapter=fields.get("adapter"),
        key_bytes=key_bytes,
    )


__all__ = [
    "KEY_BYTES",
    "KV",
    "WORDS_PER_KEY",
    "operator_fields",
    "paged_identity",
    "pool_layout",
    "ranks",
    "trailing_identity",
]
