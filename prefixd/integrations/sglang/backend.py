"""`PrefixdHiCache`: prefixd as an SGLang HiCache L3 storage backend (`HiCacheStorage`).

Each paged pool (the KV pool, and any other pool needed for every page) is an engine-keyed identity
whose chain is the call's `prefix_keys + keys` (SGLang's SHA-256 page hashes): a page is stored only
after its parents and a hit never reaches past a missing or damaged page. v0's calls carry no
prefix keys, so there each page is a chain of its own (its hash already commits to the prefix).

Trailing pools (sliding windows, recurrent states) are the checkpoint groups of one hybrid identity
(one per set of ranks that writes them) on the same chain: `batch_exists_v2` applies prefixd's
joint rule (`lookup_state`) at the paged pools' common boundary, so it reports only a prefix
every pool can restore. A daemon that is down or slow makes lookups misses and stores and loads
fail: SGLang recomputes.

All ranks or none: each rank stores its own part of a page under its own identity (identity.py),
and a page counts as stored, in the hit queries and the gets alike, only while the part of every
rank that splits the KV is stored (one lookup per part's identity, stopping at the first that
has none), so a rank whose store failed midway makes the pages it lacks misses on every rank.
An MLA model's pools (but Mamba's), which SGLang backs up on its writer rank alone, are one part
for all tp ranks (still one per pipeline stage and DCP shard).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from prefixd.client import Client
from prefixd.errors import ConfigError
from prefixd.integrations.link import DaemonLink
from prefixd.integrations.sglang.identity import (
    KEY_BYTES,
    KV,
    WORDS_PER_KEY,
    operator_fields,
    paged_parts,
    trailing_parts,
)
from prefixd.integrations.sglang.pages import Pool, copy_in, copy_out, region_tensor, tensor_bytes
from prefixd.schema.identity import Identity
from prefixd.schema.keys import pack_keys

log = logging.getLogger(__name__)

# Pools SGLang restores from their last pages only, unless the extra config's "pools" says else.
TRAILING_BY_DEFAULT = frozenset(
    {PoolName.MAMBA.value, PoolName.SWA.value, PoolName.AUXILIARY_SWA.value, "draft_swa"}
)
POLICIES = {policy.value: policy for policy in PoolHitPolicy}


def page_key(key: str) -> bytes:
    """An SGLang page hash (64 hex characters) as its 32 bytes; ConfigError for anything else."""
    try:
        raw = bytes.fromhex(key)
    except (TypeError, ValueError):
        raw = b""
    if len(raw) != KEY_BYTES:
        raise ConfigError("prefixd sglang backend: a page key is not a 64-hex SHA-256 page hash")
    return raw


class PrefixdHiCache(HiCacheStorage):  # type: ignore[misc]
    """An SGLang HiCache storage backend backed by the prefixd daemon at extra config "socket"
    (`extra_config` builds it); SGLang constructs it as `cls(storage_config, kwargs)`."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        extra: Mapping[str, Any] = storage_config.extra_config or {}
        self._config = storage_config
        self._fields = operator_fields(storage_config)  # refuses to start without weights
        if not extra.get("socket"):
            raise ConfigError("prefixd sglang backend: set extra config 'socket' (the daemon's)")
        self._region_bytes = int(extra.get("region_bytes", 256 << 20))
        # v0's batch_get / batch_set carry no prefix keys: then every paged call stores and finds
        # each page as a chain of its own, so that its hit query and its gets agree
        self._chained = bool(int(extra.get("interface_v1", 0)))
        self._declared = {str(k): str(v) for k, v in (extra.get("pools") or {}).items()}
        for name, policy in self._declared.items():
            if policy not in POLICIES:
                raise ConfigError(f"prefixd sglang backend: pool {name!r}: unknown policy")
        self._pools: dict[str, Pool] = {}
        self._paged: dict[str, Identity] = {}
        # every rank's part's identity, this rank's first, by pool (paged; trailing)
        self._parts: dict[str, tuple[Identity, ...]] = {}
        self._trailing_parts: dict[str, tuple[Identity, ...]] = {}
        self._link = DaemonLink(
            str(extra["socket"]),
            region_bytes=self._region_bytes,
            timeout_s=float(extra.get("timeout_s", 5.0)),
            name="sglang-hicache",
            label="prefixd sglang backend",
            daemon_uid=extra.get("daemon_uid"),
        )

    # --- registration -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._pools[KV] = Pool(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._pools[str(host_pool_name)] = Pool(host_pool)
        self._trailing_parts = {}  # the trailing identities name every trailing pool: built anew
        self._paged.pop(str(host_pool_name), None)
        self._parts.pop(str(host_pool_name), None)

    def on_host_pools_registered(self) -> None:
        """Build the identities now, so that a pool set this backend cannot serve fails the
        attach (a BLOCK_GROUPS pool, say) instead of every later call."""
        for name in self._pools:
            self._policy(name)
        self._identities()

    def _policy(self, name: str) -> PoolHitPolicy:
        """The extra config's "pools", else trailing for SWA and Mamba pools."""
        if name == KV:
            return PoolHitPolicy.ALL_PAGES
        default = "trailing_pages" if name in TRAILING_BY_DEFAULT else "all_pages"
        policy = POLICIES[self._declared.get(name, default)]
        if policy == PoolHitPolicy.BLOCK_GROUPS:
            raise ConfigError(
                f"prefixd sglang backend: pool {name!r} uses BLOCK_GROUPS, which prefixd does not "
                "serve (its groups of pages are neither a chain nor a checkpoint)"
            )
        return policy

    def _identities(self) -> tuple[dict[str, Identity], dict[str, tuple[Identity, ...]]]:
        """This rank's identity of each paged pool, and every part's of each trailing pool."""
        if KV not in self._pools:
            raise ConfigError("prefixd sglang backend: no KV host pool registered")
        trailing = {}
        for name, pool in self._pools.items():
            if self._policy(name) == PoolHitPolicy.TRAILING_PAGES:
                trailing[name] = pool.host_pool
            elif name not in self._paged:
                self._parts[name] = paged_parts(self._fields, self._config, name, pool.host_pool)
                self._paged[name] = self._parts[name][0]
        if trailing and not self._trailing_parts:
            self._trailing_parts = trailing_parts(self._fields, self._config, trailing)
        return self._paged, self._trailing_parts

    # --- v0: flat page tensors ----------------------------------------------------------------

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        [found] = self.batch_get([key], [target_location])
        return found

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        """Load each page into its target tensor (SGLang's dummy flat pages); None from the first
        page not stored or not verified on."""
        targets = list(target_locations or [None] * len(keys))
        if any(t is None for t in targets):
            return [None] * len(keys)

        def deliver(i: int, view: memoryview) -> bool:
            target = tensor_bytes(targets[i])
            if len(view) != target.numel() or not targets[i].is_contiguous():
                return False
            target.copy_(region_tensor(view))
            return True

        done = self._load(KV, keys, None, deliver)
        return [targets[i] if i < done else None for i in range(len(keys))]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        pages = [tensor_bytes(v) for v in values or []]
        if len(pages) != len(keys):
            return False

        def fill(i: int, destination: memoryview) -> None:
            region_tensor(destination).copy_(pages[i])

        sizes = [int(p.numel()) for p in pages]
        return self._store(KV, keys, None, sizes, fill) == len(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many of `keys`, from the first, are stored after every page before them."""
        return self._found(KV, keys, self._paged_prefix(extra_info))

    # --- v1: host-pool indices (interface_v1) -------------------------------------------------

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._get_pages(KV, keys, host_indices, self._paged_prefix(extra_info))

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        return self._set_pages(KV, keys, host_indices, self._paged_prefix(extra_info))

    # --- v2: one PoolTransfer per pool --------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The longest prefix of `keys` every pool can restore: the paged pools' common boundary,
        then prefixd's joint rule over the trailing pools' checkpoints on the chain cut there."""
        prefix, paged = _prefix(extra_info), self._paged_prefix(extra_info)
        transfers = list(pool_transfers or [])
        self._check(transfers)
        hits: dict[str, int] = {}
        boundary = hits[KV] = self._found(KV, keys, paged)
        for transfer in transfers:
            name = str(transfer.name)
            if name != KV and transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                hits[name] = self._found(name, keys[:boundary], paged)
                boundary = min(boundary, hits[name])
        # every prefix of a paged boundary is restorable; with trailing pools, the joint one
        restorable = list(range(1, boundary + 1))
        if any(t.hit_policy == PoolHitPolicy.TRAILING_PAGES for t in transfers) and boundary:
            joint = self._joint(keys[:boundary], prefix)
            for transfer in transfers:
                if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    hits[str(transfer.name)] = joint
            boundary = joint
            restorable = [joint] if joint else []
        return PoolTransferResult(boundary, {k: v for k, v in hits.items() if v}, restorable)

    def batch_get_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._per_pool(transfers, extra_info, self._get_trailing, self._get_pages)

    def batch_set_v2(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> dict[str, list[bool]]:
        return self._per_pool(transfers, extra_info, self._set_trailing, self._set_pages)

    def _per_pool(
        self,
        transfers: list[PoolTransfer],
        extra_info: HiCacheStorageExtraInfo | None,
        trailing: _PoolCall,
        paged: _PoolCall,
    ) -> dict[str, list[bool]]:
        """A v2 get or set, pool by pool: trailing pools as checkpoints, paged pools as chains."""
        self._check(transfers)
        prefix, paged_prefix = _prefix(extra_info), self._paged_prefix(extra_info)
        results = {}
        for transfer in transfers:
            name, keys = str(transfer.name), list(transfer.keys or [])
            indices = transfer.host_indices
            if not self._indices_fit(name, keys, indices):
                results[name] = [False] * len(keys)
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                results[name] = trailing(name, keys, indices, prefix)
            else:
                results[name] = paged(name, keys, indices, paged_prefix)
        return results

    def _paged_prefix(self, extra_info: HiCacheStorageExtraInfo | None) -> list[str] | None:
        """The pages before a paged call's (None: each page a chain of its own, as v0 does)."""
        return _prefix(extra_info) if self._chained else None

    def _check(self, transfers: Sequence[PoolTransfer]) -> None:
        """A transfer must name a registered pool under the policy prefixd serves it with."""
        for transfer in transfers:
            name = str(transfer.name)
            if name not in self._pools:
                raise ConfigError(f"prefixd sglang backend: pool {name!r} is not registered")
            if transfer.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                raise ConfigError(
                    f"prefixd sglang backend: pool {name!r}: BLOCK_GROUPS is not served"
                )
            if transfer.hit_policy != self._policy(name):
                raise ConfigError(
                    f"prefixd sglang backend: pool {name!r} is served as "
                    f"{self._policy(name).value}, not {PoolHitPolicy(transfer.hit_policy).value} "
                    "(set the extra config's 'pools')"
                )

    def _indices_fit(self, name: str, keys: Sequence[str], indices: torch.Tensor | None) -> bool:
        expected = len(keys) * self._pools[name].page_size
        if indices is None or indices.numel() != expected:
            log.error("prefixd sglang backend: %s host indices do not match its keys", name)
            return False
        return True

    # --- paged pools: chains of page hashes ---------------------------------------------------

    def _found(self, name: str, keys: Sequence[str], prefix: list[str] | None) -> int:
        """How many of `keys`, from the first, every rank's part is stored of."""
        self._identities()
        return self._found_in(self._parts[name], keys, prefix)

    def _found_in(
        self, identities: Sequence[Identity], keys: Sequence[str], prefix: list[str] | None
    ) -> int:
        """How many of `keys`, from the first, are stored under every one of `identities`."""
        count = len(keys)
        for identity in identities:
            if not count:
                break
            count = min(count, self._found_under(identity, keys[:count], prefix))
        return count

    def _found_under(
        self, identity: Identity, keys: Sequence[str], prefix: list[str] | None
    ) -> int:
        if not keys:
            return 0
        if prefix is None:
            prompts = [pack_keys(identity, [page_key(k)]) for k in keys]
            found = self._link.call(lambda c: c.lookup(identity, prompts))
            return sum(1 for _ in itertools.takewhile(lambda hit: hit.n_blocks == 1, found or []))
        words = pack_keys(identity, [page_key(k) for k in [*prefix, *keys]])
        found = self._link.call(lambda c: c.lookup(identity, [words]))
        return _clamp(found[0].n_blocks - len(prefix), len(keys)) if found else 0

    def _get_pages(
        self, name: str, keys: Sequence[str], indices: torch.Tensor, prefix: list[str] | None
    ) -> list[bool]:
        pool = self._pools[name]

        def deliver(i: int, view: memoryview) -> bool:
            return copy_in(pool, int(indices[i * pool.page_size]), view)

        done = self._load(name, keys, prefix, deliver)
        return [i < done for i in range(len(keys))]

    def _set_pages(
        self, name: str, keys: Sequence[str], indices: torch.Tensor, prefix: list[str] | None
    ) -> list[bool]:
        pool = self._pools[name]

        def fill(i: int, destination: memoryview) -> None:
            copy_out(pool, int(indices[i * pool.page_size]), destination)

        done = self._store(name, keys, prefix, [pool.page_bytes] * len(keys), fill)
        return [i < done for i in range(len(keys))]

    def _load(
        self,
        name: str,
        keys: Sequence[str],
        prefix: list[str] | None,
        deliver: Callable[[int, memoryview], bool],
    ) -> int:
        """Load `keys`' verified payloads, handing page i's to `deliver(i, view)` (False: not
        usable); how many leading pages made it. Only pages whose other ranks' parts are all
        stored are loaded."""
        identity = self._identities()[0][name]
        keys = keys[: self._found_in(self._parts[name][1:], keys, prefix)]
        for start, chain, first, count in self._runs(identity, keys, prefix, self._per_call(name)):
            result = self._link.call(
                lambda c: c.load(identity, chain, first_block=first, max_blocks=count)  # noqa: B023
            )
            if result is None:
                return start
            with result:
                for i, view in enumerate(result.views[:count]):
                    if not deliver(start + i, view):
                        return start + i
                if int(result.n_blocks) < count:
                    return start + int(result.n_blocks)
        return len(keys)

    def _store(
        self,
        name: str,
        keys: Sequence[str],
        prefix: list[str] | None,
        sizes: Sequence[int],
        fill: Callable[[int, memoryview], None],
    ) -> int:
        """Store `keys`' pages, written by `fill(i, destination)` straight into leased region
        space (not those the daemon holds already); how many leading pages are stored."""
        identity = self._identities()[0][name]
        have = self._found_under(identity, keys, prefix) if prefix is not None else 0
        per_call = self._per_call(name)
        for start, chain, first, count in self._runs(identity, keys, prefix, per_call, have):
            run = partial(
                _put_run, identity, chain, first, range(start, start + count), sizes, fill
            )
            if self._link.call(run) is None:  # the daemon away or refusing: logged
                return start
        return len(keys)

    def _runs(
        self,
        identity: Identity,
        keys: Sequence[str],
        prefix: list[str] | None,
        per_call: int,
        skip: int = 0,
    ) -> list[tuple[int, bytes, int, int]]:
        """(index of the first key, packed chain, first block, count) per daemon call."""
        if prefix is None:
            return [(i, pack_keys(identity, [page_key(k)]), 0, 1) for i, k in enumerate(keys)]
        chain = [page_key(k) for k in [*prefix, *keys]]
        runs = []
        for start in range(skip, len(keys), per_call):
            count = min(per_call, len(keys) - start)
            end = len(prefix) + start + count
            runs.append((start, pack_keys(identity, chain[:end]), len(prefix) + start, count))
        return runs

    def _per_call(self, name: str) -> int:
        return max(1, self._region_bytes // max(1, self._pools[name].page_bytes))

    # --- trailing pools: checkpoints of one hybrid identity -----------------------------------

    def _joint(self, keys: Sequence[str], prefix: list[str] | None) -> int:
        """prefixd's joint boundary over `prefix + keys`, in pages of `keys`, that every rank's
        part restores at. A part that stops short moves the boundary back, and every other part
        is asked again there: its checkpoints need not be where the first one's are."""
        parts = self._every_trailing_part()
        boundary, agreed, at = len(keys), 0, 0
        while boundary and agreed < len(parts):
            found = self._joint_under(parts[at % len(parts)], keys[:boundary], prefix)
            agreed = 1 if found < boundary else agreed + 1
            boundary, at = min(boundary, found), at + 1
        return boundary

    def _joint_under(
        self, identity: Identity, keys: Sequence[str], prefix: list[str] | None
    ) -> int:
        before = len(prefix or [])
        words = _words([*(prefix or []), *keys])
        found = self._link.call(lambda c: c.lookup_state(identity, [words]))
        if not found:
            return 0
        return _clamp(found[0].reusable_tokens // WORDS_PER_KEY - before, len(keys))

    def _set_trailing(
        self, name: str, keys: Sequence[str], indices: torch.Tensor, prefix: list[str] | None
    ) -> list[bool]:
        """The pool's last len(keys) pages as one checkpoint at the boundary they end (the
        chain's blocks are stored with it, so it may come before the KV pages do)."""
        if not keys:
            return []
        pool, identity = self._pools[name], self._trailing_identity(name)
        view = memoryview(bytearray(len(keys) * pool.page_bytes))
        for i in range(len(keys)):
            at = i * pool.page_bytes
            copy_out(pool, int(indices[i * pool.page_size]), view[at : at + pool.page_bytes])
        chain = [*(prefix or []), *keys]
        boundary = len(chain) * WORDS_PER_KEY
        put = self._link.call(
            lambda c: c.put_state(identity, _words(chain), checkpoints={name: {boundary: view}})
        )
        return [put is not None] * len(keys)

    def _get_trailing(
        self, name: str, keys: Sequence[str], indices: torch.Tensor, prefix: list[str] | None
    ) -> list[bool]:
        """The checkpoint at the boundary `keys` end, when prefixd's joint rule reaches it."""
        if not keys:
            return []
        pool, identity = self._pools[name], self._trailing_identity(name)
        others = [part for part in self._every_trailing_part() if part != identity]
        if any(self._joint_under(other, keys, prefix) < len(keys) for other in others):
            return [False] * len(keys)  # another rank's part does not reach the keys' end
        chain = [*(prefix or []), *keys]
        result = self._link.call(lambda c: c.load_state(identity, _words(chain)))
        if result is None:
            return [False] * len(keys)
        with result:
            states = [p.view for p in result.parts if p.group == name and p.view is not None]
            at_end = result.reusable_tokens == len(chain) * WORDS_PER_KEY
            if not at_end or not states or len(states[0]) != len(keys) * pool.page_bytes:
                return [False] * len(keys)
            state = states[0]
            ok = [
                copy_in(
                    pool,
                    int(indices[i * pool.page_size]),
                    state[i * pool.page_bytes : (i + 1) * pool.page_bytes],
                )
                for i in range(len(keys))
            ]
        return [all(ok)] * len(keys)

    def _trailing_identity(self, name: str | None = None) -> Identity:
        """This rank's identity of trailing pool `name` (None: of the first by name)."""
        parts = self._identities()[1]
        if not parts:
            raise ConfigError("prefixd sglang backend: no trailing pool registered")
        return parts[min(parts) if name is None else name][0]

    def _every_trailing_part(self) -> list[Identity]:
        """Every part's identity of every trailing pool, each once: the joint rule's to agree on
        (an MLA model's Mamba state is a part per tp rank, its sliding window one shared)."""
        self._trailing_identity()
        return list(dict.fromkeys(itertools.chain.from_iterable(self._trailing_parts.values())))

    # --- the daemon ---------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        """The link to the daemon, for an operator (DaemonLink.status); not `get_stats`, which
        SGLang wants as its StorageMetrics."""
        return self._link.status()

    def clear(self) -> None:
        """SGLang's `clear` drops what the backend holds; prefixd's entries are the daemon's
        (shared, persistent, evicted and purged there), so nothing is removed."""

    def close(self) -> None:
        self._link.close()


# A v2 transfer of one pool: (pool name, page keys, host indices, the pages before) -> per key
_PoolCall = Callable[[str, Sequence[str], "torch.Tensor", list[str] | None], list[bool]]


def _prefix(extra_info: HiCacheStorageExtraInfo | None) -> list[str] | None:
    if extra_info is None or extra_info.prefix_keys is None:
        return None
    return list(extra_info.prefix_keys)


def _words(keys: Sequence[str]) -> bytes:
    """Page hashes as a hybrid chain's words (8 little-endian words each)."""
    return b"".join(page_key(k) for k in keys)


def _clamp(value: int, most: int) -> int:
    return max(0, min(most, value))


def _put_run(
    identity: Identity,
    chain: bytes,
    first: int,
    pages: range,
    sizes: Sequence[int],
    fill: Callable[[int, memoryview], None],
    client: Client,
) -> bool:
    """Put `pages` (written by `fill` straight into one lease) as blocks `first`.. of `chain`."""
    lease = client.reserve(sum(sizes[i] for i in pages))
    try:
        spans, at = [], 0
        for i in pages:
            fill(i, lease.slice(at, at + sizes[i]))
            spans.append((lease.offset + at, sizes[i]))
            at += sizes[i]
        client.put_spans(identity, chain, spans, first_block=first, lease=lease)
    finally:
        lease.release()
    return True


__all__ = ["PrefixdHiCache", "page_key"]
