"""The prefixd identity and key of an LMCache object.

LMCache's `ObjectKey` (a chunk hash committing to the whole prefix, the model name, KV rank, object
group and cache salt) does not say which weights, tokenizer, template or RoPE made the KV, so the
operator says it in `adapter_params`, and the adapter refuses to start without a weights identity
rather than share entries across versions of a model. Each field's source:

  model         ObjectKey.model_name
  weights       `weights` (a revision or digest), or `weights_from`: a local model directory,
                fingerprinted like the daemon's --model-manifests; required
  tokenizer     `tokenizer` (default "lmcache-token-ids": the chunk hashes cover the token ids)
  template      `template` (default "none": the template shapes the token ids, which are hashed)
  rope          `rope` (default "model-config": set it when the engine overrides RoPE scaling)
  mm            the multimodal preprocessing files of the `weights_from` directory (their
                fingerprint), None without any
  kv_layout     "lmcache chunk_hash_bytes=N objects=L" plus `kv_layout`: L is LMCache's own layout
                of the object (each tensor's dtype and shape: `layout_of`), so an engine restarted
                with another KV dtype or shape, whose chunks have the same keys and often the
                same size, never reads the old one's bytes
  block_tokens  `chunk_tokens` (LMCache's chunk size, default 256: what a hit saves)
  tenant        `tenant` (default "lmcache"); a cache salt S makes it "<tenant>/salt=S", so salts
                never share entries and each has its own bytes, quota and purge
  key           the chunk hash, then the KV rank and object group (u32 big-endian each)

Each key is a chain of one block: the chunk hash already commits to the prefix, and LMCache asks
for keys one by one (a bitmap, not a prefix length).

A tensor-parallel (or pipelined, or DCP-sharded) engine stores a chunk as one part per KV rank,
and LMCache packs the number of parts into every rank (`ObjectKey.ComputeKVRank`: world size,
global rank, local world size, local rank, a byte each; MLA's parts are per pipeline stage and DCP
shard, the tp ranks sharing them). `rank_parts` names every rank's part of a key's chunk: the
adapter reports a key present only while all of them are stored.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from prefixd.errors import ConfigError
from prefixd.integrations.identity import (
    digest_of,
    identity_of,
    local_preprocessing,
    local_weights,
)
from prefixd.schema.identity import MAX_KEY_BYTES, MIN_KEY_BYTES, Identity

SALT_MARK = "/salt="
_WORD = 4  # kv_rank and object_group_id, u32 big-endian each
_TRAILER = 2 * _WORD
_LAYOUT_TEXT = 256  # a longer layout is named by its digest: identity fields hold 4 KiB


@dataclasses.dataclass(frozen=True)
class Settings:
    """The adapter's `adapter_params`, checked once at start (unknown names are refused: a
    misspelt `weights` must not fall back to a default)."""

    socket: str
    weights: str
    tenant: str = "lmcache"
    tokenizer: str = "lmcache-token-ids"
    template: str = "none"
    rope: str = "model-config"
    kv_layout: str = ""
    chunk_tokens: int = 256
    region_bytes: int = 256 << 20
    load_lanes: int = 2
    timeout_s: float = 5.0
    reconnect_s: float = 1.0
    daemon_uid: int | str | None = None
    usage_refresh_s: float = 1.0
    mm: str | None = None  # read from `weights_from`, never given

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> Settings:
        known = {f.name for f in dataclasses.fields(cls)} - {"mm"} | {"weights_from"}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"prefixd L2 adapter: unknown adapter_params {unknown}")
        if not params.get("socket"):
            raise ConfigError("prefixd L2 adapter: adapter_params needs `socket` (the daemon's)")
        values = {k: v for k, v in params.items() if k != "weights_from"}
        values["weights"] = weights_of(params)
        if params.get("weights_from"):
            values["mm"] = local_preprocessing(Path(str(params["weights_from"])))
        settings = cls(**values)
        for name in ("tenant", "tokenizer", "template", "rope", "kv_layout"):
            if not isinstance(getattr(settings, name), str):
                raise ConfigError(f"prefixd L2 adapter: {name} must be text")
        if SALT_MARK in settings.tenant or not settings.tenant:
            raise ConfigError(f"prefixd L2 adapter: tenant may not hold {SALT_MARK!r}")
        if settings.chunk_tokens < 1:
            raise ConfigError("prefixd L2 adapter: chunk_tokens must be at least 1")
        if type(settings.load_lanes) is not int or not 1 <= settings.load_lanes <= 16:
            raise ConfigError("prefixd L2 adapter: load_lanes must be from 1 to 16")
        return settings


def weights_of(params: Mapping[str, Any]) -> str:
    """`weights` as is, or the fingerprint of the model directory `weights_from`; neither is a
    refusal, never a default."""
    weights, local = params.get("weights"), params.get("weights_from")
    if weights and local:
        raise ConfigError("prefixd L2 adapter: give `weights` or `weights_from`, not both")
    if weights:
        return str(weights)
    if not local:
        raise ConfigError(
            "prefixd L2 adapter: adapter_params needs `weights` (a revision or digest of the "
            "model's weights) or `weights_from` (its local directory): without it, entries of "
            "different versions of a model would be shared"
        )
    path = Path(str(local))
    if not (path / "config.json").is_file():
        raise ConfigError(f"prefixd L2 adapter: weights_from {path} holds no config.json")
    return local_weights(path)


def layout_of(shapes: Iterable[Sequence[int]], dtypes: Iterable[object]) -> str:
    """A memory object's layout as LMCache describes it (MemoryLayoutDesc, or the object's own
    metadata): each tensor's dtype and shape, "bfloat16[2,2,256,64]", joined by "+"; its digest
    when that is longer than _LAYOUT_TEXT (an object of many tensors)."""
    text = "+".join(
        f"{str(dtype).removeprefix('torch.')}[{','.join(map(str, shape))}]"
        for shape, dtype in zip(shapes, dtypes, strict=True)
    )
    return text if len(text) <= _LAYOUT_TEXT else digest_of(text)


class Identities:
    """Identities by (model name, chunk hash length, cache salt, object layout), built once each."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._known: dict[tuple[str, int, str, str], Identity] = {}

    def of(
        self, model_name: str, hash_bytes: int, cache_salt: str, objects: str
    ) -> Identity | None:
        """The identity of an object of layout `objects` (`layout_of`); None when its chunk
        hash cannot make an engine key."""
        known = self._known.get((model_name, hash_bytes, cache_salt, objects))
        if known is not None:
            return known
        width = hash_bytes + _TRAILER
        if hash_bytes % _WORD or not MIN_KEY_BYTES <= width <= MAX_KEY_BYTES:
            return None
        s = self._settings
        layout = f"lmcache chunk_hash_bytes={hash_bytes} objects={objects}" + (
            f" {s.kv_layout}" if s.kv_layout else ""
        )
        identity = identity_of(
            {**dataclasses.asdict(s), "model": model_name},
            kv_layout=layout,
            block_tokens=s.chunk_tokens,
            tenant=tenant_of(s.tenant, cache_salt),
            key_bytes=width,
        )
        if len(self._known) >= 4096:
            self._known.clear()
        self._known[(model_name, hash_bytes, cache_salt, objects)] = identity
        return identity


def tenant_of(tenant: str, cache_salt: str) -> str:
    return f"{tenant}{SALT_MARK}{cache_salt}" if cache_salt else tenant


def salt_of(tenant: str, stored_tenant: str) -> str | None:
    """The cache salt whose entries `stored_tenant` holds, None if it is not this adapter's."""
    if stored_tenant == tenant:
        return ""
    prefix = tenant + SALT_MARK
    return stored_tenant[len(prefix) :] if stored_tenant.startswith(prefix) else None


def key_of(chunk_hash: bytes, kv_rank: int, object_group_id: int) -> bytes:
    """The engine key: the chunk hash, then the rank and the object group, u32 big-endian."""
    return (
        bytes(chunk_hash) + kv_rank.to_bytes(_WORD, "big") + object_group_id.to_bytes(_WORD, "big")
    )


def rank_parts(kv_rank: int) -> tuple[int, ...]:
    """The KV ranks of every part of the chunk a `kv_rank` holds a part of, in rank order. A rank
    that is no `ComputeKVRank` packing of a world of two or more (0, a small integer, or fields
    that disagree) is the chunk's only part."""
    world, rank = (kv_rank >> 24) & 0xFF, (kv_rank >> 16) & 0xFF
    local_world, local_rank = (kv_rank >> 8) & 0xFF, kv_rank & 0xFF
    if (
        world < 2
        or kv_rank >> 32
        or rank >= world
        or not 0 < local_world <= world
        or local_rank != rank % local_world
    ):
        return (kv_rank,)
    return tuple(
        (world << 24) | (other << 16) | (local_world << 8) | (other % local_world)
        for other in range(world)
    )


def split_key(key: bytes) -> tuple[bytes, int, int]:
    """(chunk hash, kv rank, object group id) of an engine key made by `key_of`."""
    end = len(key) - _TRAILER
    return (
        bytes(key[:end]),
        int.from_bytes(key[end : end + _WORD], "big"),
        int.from_bytes(key[end + _WORD :], "big"),
    )


__all__ = [
    "Identities",
    "Settings",
    "key_of",
    "layout_of",
    "rank_parts",
    "salt_of",
    "split_key",
    "tenant_of",
    "weights_of",
]
