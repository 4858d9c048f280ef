"""The store: LMDB transactions over the prefix chain. Bytes <-> chunks is the codec's business.

Invariants every write transaction keeps:
  * a block is stored only if its whole ancestry is stored and matches the writer's tokens, so a
    stored block is reachable exactly when its prefix is (there are no orphans);
  * a block is written once and never modified (one owner); removing a block removes its subtree;
  * records, chunks, the children index and the counters change in the same transaction.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import lmdb
import msgpack

from prefixd.clock import Clock, SystemClock
from prefixd.errors import (
    BlockCollisionError,
    CorruptStoreError,
    DestinationError,
    DiskFullError,
    IdentityError,
    OpenTailError,
    OrphanBlockError,
    PayloadError,
    PrefixdError,
    PutRefusedError,
    StoreClosedError,
    StoreFullError,
    StoreOpenError,
    StoreWriteError,
    TokenError,
)
from prefixd.schema.chain import HASH_BYTES, ROOT_PARENT, BlockChain
from prefixd.schema.identity import Identity
from prefixd.schema.records import (
    AccessRecord,
    BlockRecord,
    Compression,
    CorruptRecordError,
    PartRecord,
    chunk_key,
    part_key,
)
from prefixd.schema.state import StateSpec
from prefixd.schema.tokens import TokenIds, as_token_array
from prefixd.store import counters
from prefixd.store.check import check_store
from prefixd.store.codec import (
    EncodedPayload,
    PayloadCodec,
    StoredPayload,
    chunks_present,
    payload_view,
)
from prefixd.store.config import (
    SHARE_PREFIX,
    StoreConfig,
    parse_share_groups,
    parse_tenant_durations,
    parse_tenant_quotas,
)
from prefixd.store.environment import OwnerLock, Tables, open_environment
from prefixd.store.eviction import VictimQueue
from prefixd.store.joint import JointMatch, PlannedPart, joint_match, plan_put
from prefixd.store.lookup_memo import VerifiedPrefixes
from prefixd.store.purge import (
    PurgeReport,
    PurgeSelector,
    children_of,
    idle_blocks,
    selected_identities,
    subtree_totals,
)
from prefixd.store.repair import BLOCK_PROBLEMS, rebuild_derived
from prefixd.store.results import (
    BlockInfo,
    EvictionReport,
    ExportedBlock,
    LoadResult,
    PrefixMatch,
    Problem,
    PutResult,
    ReadResult,
    RepairReport,
    StateLoad,
    StoreStats,
)
from prefixd.store.syncer import PeriodicSyncer
from prefixd.store.tenancy import TenantIndex
from prefixd.store.walk import Walk, walk_chain
from prefixd.store.warmup import HotPrefix, hottest_prefixes

log = logging.getLogger(__name__)
_Method = TypeVar("_Method", bound=Callable[..., Any])
_BAD_RECORD = "record fails verification"
# Without a capacity setting, payloads may fill this share of the map: records, indexes and
# LMDB's free pages need the rest.
DEFAULT_CAPACITY_SHARE = 0.8
_BAD_PAYLOAD = "payload fails its checksum"
_BAD_PART = "state-group payload fails verification"
_ACCESS_BATCH = 1024  # access records written per transaction by `sync`
# Below this much free space, a failed commit is taken for a full file system.
DISK_FULL_BYTES = 16 << 20
_NO_PAYLOAD = EncodedPayload(Compression.NONE, [], 0, 0, 0, 0)


class _Damaged(NamedTuple):
    """A block that failed verification, the children-index key it hangs under, the identity it
    was read for, and why (its record may be too damaged to tell the last two)."""

    block: bytes
    parent_key: bytes
    identity: bytes
    reason: str


def _pages_checked(method: _Method) -> _Method:
    """Report a damaged LMDB page met by a read as CorruptStoreError (the caller can act on it:
    `prefixd verify`, or delete the store), never as an lmdb error from below."""

    @functools.wraps(method)
    def checked(self: Store, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError) as exc:
            raise CorruptStoreError(f"{self.path} has damaged pages: {exc}") from None

    return checked  # type: ignore[return-value]


class _Refusal(Exception):
    """Raised inside a write transaction to abort it; `put` re-raises `error` to the caller."""

    def __init__(
        self, error: PutRefusedError, collided: bool, damaged: _Damaged | None = None
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.collided = collided
        self.damaged = damaged


@dataclass
class _Activity:
    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0


class Store:
    """A persistent prefix store in one LMDB environment.

    Open it in the process that uses it (after any fork). Methods are thread-safe; the store must
    not be closed while other threads still call it.
    """

    def __init__(
        self, config: StoreConfig, *, exclusive: bool = False, clock: Clock | None = None
    ) -> None:
        """`exclusive`: hold the store's owner lock (a daemon does) so that offline tools refuse
        to run beside this process; StoreBusyError if another process holds it. `clock`: what
        entry ages and time to live are read from (tests pass a ManualClock)."""
        self.config = config
        self._clock: Clock = clock or SystemClock()
        self._env, self._tables, self.meta = open_environment(config)
        try:
            self._owner = OwnerLock(config.path) if exclusive else None
        except BaseException:
            self._env.close()
            raise
        """The meta record read (or written) when the store was opened."""
        self._pid = os.getpid()
        self._codec = PayloadCodec(
            config.compression,
            level=config.zstd_level,
            min_gain=config.min_compression_gain,
            chunk_bytes=config.chunk_bytes,
        )
        self._pool = (
            ThreadPoolExecutor(config.verify_threads, thread_name_prefix="prefixd-verify")
            if config.verify_threads
            else None
        )
        self._verified = VerifiedPrefixes(config.verified_cache_bytes)
        self._tenants = TenantIndex(self._tables.identities)
        self._capacity = config.capacity_bytes or int(config.map_size * DEFAULT_CAPACITY_SHARE)
        self._ttl_s = parse_tenant_durations(config.tenant_ttls)
        self._quotas = parse_tenant_quotas(config.tenant_quotas)
        self._share_group = {
            tenant: group
            for group, tenants in parse_share_groups(config.share_groups).items()
            for tenant in tenants
        }
        self._shared: dict[Identity, Identity] = {}
        self._lock = threading.Lock()
        self._touched: dict[bytes, tuple[int, int]] = {}
        self._touched_runs: dict[bytes, tuple[Sequence[bytes], int, int]] = {}
        self._pending_collisions = 0
        self._removals: Counter[tuple[str, str]] = Counter()
        self._activity = _Activity()
        self._closed = False
        self._syncer = PeriodicSyncer(self.sync, config.sync_interval_s)
        self._syncer.start()

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        exclusive: bool = False,
        clock: Clock | None = None,
        **settings: Any,
    ) -> Store:
        """Open the store at `path`; `settings` are `StoreConfig` fields."""
        return cls(StoreConfig(path=Path(path), **settings), exclusive=exclusive, clock=clock)

    @property
    def path(self) -> Path:
        return self.config.path

    # --- writing -------------------------------------------------------------------------------

    def put(
        self,
        identity: Identity,
        token_ids: TokenIds,
        payloads: Sequence[Any],
        *,
        first_block: int = 0,
    ) -> PutResult:
        """Publish blocks `first_block .. first_block + len(payloads) - 1` of `token_ids` atomically.

        `token_ids` holds the whole prefix from the first token (the chain needs it); tokens past
        the last payload's block are ignored. Refused whole, with nothing written: a block with
        fewer than `block_tokens` tokens (OpenTailError), a first block whose parent chain is not
        stored (OrphanBlockError), a hash owned by other tokens (BlockCollisionError), an empty or
        non-contiguous payload (PayloadError); a full map raises StoreFullError.
        """
        self._check_usable()
        if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
            raise PayloadError(f"first_block must be a non-negative int, got {first_block!r}")
        identity, _ = self._namespace(identity, None)
        _require_plain(identity, "put_state")
        chain = BlockChain(identity, token_ids)
        views = [
            payload_view(p, f"payload of block {first_block + i}") for i, p in enumerate(payloads)
        ]
        if not views:
            return PutResult(0, 0, ())
        end = first_block + len(views)
        if end > chain.n_blocks:
            have = len(chain.tokens) - chain.n_blocks * chain.block_tokens
            raise OpenTailError(
                f"block {chain.n_blocks} has {have if end == chain.n_blocks + 1 else 'too few'} of "
                f"{chain.block_tokens} tokens: only closed blocks are stored"
            )
        hashes = [chain.hash(i) for i in range(first_block, end)]
        with self._env.begin(buffers=True) as txn:
            absent = [txn.get(h, db=self._tables.blocks) is None for h in hashes]
        todo = [i for i, missing in enumerate(absent) if missing]
        encoded: dict[int, EncodedPayload] = dict(
            zip(
                (first_block + i for i in todo),
                self._codec.encode_many([views[i] for i in todo], self._pool),
            )
        )
        return self._publish(
            lambda: self._put_txn(identity, chain, first_block, views, encoded), identity.tenant
        )

    def _publish(self, write: Callable[[], tuple[PutResult, int]], tenant: str) -> PutResult:
        """Run a put's write transaction (settling and evicting on a full map), then keep the
        store within its capacity and the tenant within its quota."""
        try:
            result, replaced = self._put_with_settle(write, tenant)
        except lmdb.MapFullError:
            raise StoreFullError(
                f"store map of {self.config.map_size} bytes is full; the put was rolled back"
            ) from None
        except lmdb.Error as exc:
            raise self._write_failure(exc) from None
        except _Refusal as refusal:
            if refusal.collided:
                with self._lock:
                    self._pending_collisions += 1
            if refusal.damaged is not None:
                self._quarantine([refusal.damaged])
            raise refusal.error from None
        if replaced:
            log.warning("replaced %d stored block(s) whose records failed verification", replaced)
        return result

    def _write_failure(self, exc: lmdb.Error) -> PrefixdError:
        """What a failed write transaction means for the caller. LMDB reports a file system
        without room as an I/O error at commit, so the free space tells the two apart."""
        if isinstance(exc, (lmdb.CorruptedError, lmdb.PageNotFoundError)):
            return CorruptStoreError(f"{self.path} has damaged pages: {exc}")
        try:
            free = os.statvfs(self.path).f_bavail * os.statvfs(self.path).f_frsize
        except OSError:
            free = -1
        if 0 <= free < DISK_FULL_BYTES:
            return DiskFullError(
                f"the file system under {self.path} is full ({free} bytes free); the write was "
                "rolled back, reads go on, and writes resume once space is freed"
            )
        return StoreWriteError(f"the write to {self.path} failed and was rolled back: {exc}")

    def _put_with_settle(
        self, write: Callable[[], tuple[PutResult, int]], tenant: str
    ) -> tuple[PutResult, int]:
        """Run the put; on a full map, make room and try again.

        LMDB reuses the pages a transaction frees only once a later transaction has committed, so
        right after a delete the map can look full although the space is there: first one small
        settling commit, then eviction (to the low watermark) and a settling commit."""
        try:
            result = write()
        except lmdb.MapFullError:
            self._settle()
            try:
                result = write()
            except lmdb.MapFullError:
                if not self.evict().blocks:
                    raise
                self._settle()
                result = write()
        if not (result[0].stored or result[0].parts):
            return result
        high = self.config.high_watermark
        if self._stored_bytes() > self._capacity * high:
            self.evict()
        quota = self._quotas.get(tenant, self.config.tenant_quota_bytes)
        if quota and self.tenant_bytes(tenant) > quota * high:
            self.evict(int(quota * self.config.low_watermark), tenant=tenant)
        return result

    def _settle(self) -> None:
        with self._env.begin(write=True) as txn:
            counters.add(txn, self._tables.counters, counters.SETTLES, 1)

    def _stored_bytes(self) -> int:
        with self._env.begin() as txn:
            return counters.read(txn, self._tables.counters, counters.STORED_BYTES)

    def tenant_bytes(self, tenant: str) -> int:
        """Stored bytes of every identity of `tenant` (what its quota limits)."""
        with self._env.begin() as txn:
            return self._tenant_stored(txn, self._tenants.digests_of(txn, tenant))

    def _tenant_stored(self, txn: lmdb.Transaction, digests: set[bytes]) -> int:
        return sum(
            counters.read(txn, self._tables.counters, counters.identity_stored(d)) for d in digests
        )

    def evict(
        self, target_bytes: int | None = None, *, tenant: str | None = None
    ) -> EvictionReport:
        """Evict leaves, lowest value per byte first (see prefixd.store.eviction), until the
        stored bytes are at most `target_bytes` (default: the low watermark of the capacity).
        With `tenant`, only that tenant's blocks are candidates and its bytes are what counts."""
        self._check_usable()
        if self.config.eviction == "none":
            return EvictionReport(0, 0, 0.0)
        started = time.perf_counter()
        target = (
            int(self._capacity * self.config.low_watermark)
            if target_bytes is None
            else target_bytes
        )
        evicted = freed = 0
        t = self._tables
        self.reclaim_expired()  # what no lookup can reach goes first
        self.sync()  # the reads still counted in memory must be weighed too
        with self._env.begin(write=True) as txn:
            owned = None if tenant is None else self._tenants.digests_of(txn, tenant)
            if owned is None:
                stored = counters.read(txn, t.counters, counters.STORED_BYTES)
            else:
                stored = self._tenant_stored(txn, owned)
            if stored > target:
                queue = VictimQueue(txn, t, self.config.eviction, self._clock.time_ns(), owned)
                for victim in queue:
                    if stored <= target:
                        break
                    self._remove_subtree(txn, victim.block, reason="evicted")
                    stored -= victim.stored_size
                    freed += victim.stored_size
                    evicted += 1
                    queue.parent_freed(victim.parent_key)
                counters.add(txn, t.counters, counters.EVICTED, evicted)
        if evicted:
            log.info("evicted %d block(s), %d bytes", evicted, freed)
        return EvictionReport(evicted, freed, round(time.perf_counter() - started, 6))

    def _put_txn(
        self,
        identity: Identity,
        chain: BlockChain,
        first_block: int,
        views: list[memoryview],
        encoded: dict[int, EncodedPayload],
    ) -> tuple[PutResult, int]:
        t = self._tables
        digest = identity.digest
        now = self._clock.time_ns()
        stored = existed = replaced = 0
        payload_bytes = stored_bytes = 0
        min_created = self._min_created_ns(identity)
        with self._env.begin(write=True) as txn:
            self._check_ancestry(txn, chain, first_block, min_created)
            txn.put(digest, identity.encode(), db=t.identities, overwrite=False)
            for index in range(first_block, first_block + len(views)):
                present, dropped = self._claim_block(txn, chain, index, min_created)
                replaced += dropped
                if present:
                    existed += 1
                    continue
                payload = encoded.get(index) or self._codec.encode(views[index - first_block])
                self._write_block(txn, chain, index, payload, now)
                stored += 1
                payload_bytes += payload.payload_size
                stored_bytes += payload.stored_size
            counters.add(txn, t.counters, counters.BLOCKS, stored)
            counters.add(txn, t.counters, counters.PAYLOAD_BYTES, payload_bytes)
            counters.add(txn, t.counters, counters.STORED_BYTES, stored_bytes)
            counters.add(txn, t.counters, counters.identity_stored(digest), stored_bytes)
            counters.add(txn, t.counters, counters.identity_blocks(digest), stored)
        hashes = tuple(chain.hash(i) for i in range(first_block, first_block + len(views)))
        return PutResult(stored, existed, hashes), replaced

    def _write_block(
        self,
        txn: lmdb.Transaction,
        chain: BlockChain,
        index: int,
        payload: EncodedPayload | None,
        now: int,
    ) -> None:
        """Write block `index`'s record, chunks, index entry and access record (no counters).
        A block of a hybrid identity has no payload of its own: its state is in parts."""
        t = self._tables
        h = chain.hash(index)
        payload = payload or _NO_PAYLOAD
        record = BlockRecord(
            payload.compression,
            payload.chunk_bytes,
            len(payload.chunks),
            payload.checksum,
            payload.payload_size,
            payload.stored_size,
            now,
            chain.identity.digest,
            chain.parent_of(index),
            bytes(chain.block_bytes(index)),
        )
        txn.put(h, record.encode(), db=t.blocks)
        _put_chunks(txn, t, h, payload.chunks)
        txn.put(_children_key(record), h, db=t.children)
        txn.put(h, AccessRecord(now, 0).encode(), db=t.access)

    def _check_ancestry(
        self, txn: lmdb.Transaction, chain: BlockChain, first_block: int, min_created: int
    ) -> list[bytes]:
        """The stored blocks 0..first_block-1 of `chain`; refuse the put if any is not stored."""
        walk = walk_chain(txn, self._tables.blocks, chain, first_block, None, min_created)
        if len(walk.hashes) < first_block:
            missing = len(walk.hashes)
            if walk.collided:
                error: PutRefusedError = BlockCollisionError(
                    f"block {missing} of the prefix is owned by other tokens"
                )
            else:
                state = "damaged" if walk.corrupt else "expired" if walk.expired else "missing"
                error = OrphanBlockError(
                    f"block {first_block}'s ancestry is not stored (block {missing} is "
                    f"{state}); put from block {missing}"
                )
            raise _Refusal(error, walk.collided, _damaged_record(walk, chain))
        return walk.hashes

    def _claim_block(
        self, txn: lmdb.Transaction, chain: BlockChain, index: int, min_created: int
    ) -> tuple[bool, int]:
        """(whether block `index` is stored already and matches, damaged records dropped).

        A damaged record, or one past its tenant's time to live, is removed with everything
        below it so the block is written afresh; a hash owned by other tokens refuses the put."""
        t = self._tables
        digest = chain.identity.digest
        h = chain.hash(index)
        parent = chain.parent_of(index)
        raw = txn.get(h, db=t.blocks)
        if raw is None:
            return False, 0
        try:
            record = BlockRecord.decode(raw)
        except CorruptRecordError:
            self._remove_subtree(txn, h, _parent_key(digest, parent), digest, reason="quarantined")
            self._record_quarantine(txn, h, _BAD_RECORD)
            return False, 1
        if (
            record.identity != digest
            or record.parent != parent
            or record.tokens != chain.block_bytes(index)
        ):
            error = BlockCollisionError(f"block {index}'s hash is owned by other tokens")
            raise _Refusal(error, collided=True)
        if record.created_ns >= min_created:
            return True, 0
        # past its tenant's time to live: stored afresh (with nothing below it)
        self._remove_subtree(txn, h, _parent_key(digest, parent), digest, reason="expired")
        return False, 0

    def delete(self, hashes: Iterable[bytes]) -> int:
        """Remove the given blocks and every block below them; return how many blocks went."""
        self._check_usable()
        removed = 0
        with self._writing():
            with self._env.begin(write=True) as txn:
                for h in hashes:
                    removed += self._remove_subtree(txn, bytes(h), reason="deleted")
        return removed

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Turn a failed write transaction into the error a caller can act on."""
        try:
            yield
        except lmdb.MapFullError:
            raise StoreFullError(f"store map of {self.config.map_size} bytes is full") from None
        except lmdb.Error as exc:
            raise self._write_failure(exc) from None

    def purge(
        self,
        selector: PurgeSelector,
        *,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
    ) -> PurgeReport:
        """Remove what `selector` names, in one transaction: unreachable at once, pages freed
        once in-flight reads (which keep their snapshot) are done. A dry run counts only.
        `progress` is told how many root blocks each step handled."""
        self._check_usable()
        started = time.perf_counter()
        if selector.older_than_s is not None and not dry_run:
            self.sync()  # access times still in memory count
        t = self._tables
        cutoff = self._clock.time_ns() - int((selector.older_than_s or 0) * 1e9)
        reason = "retired" if selector.model is not None else "purged"
        begin = self._env.begin(buffers=True) if dry_run else self._env.begin(write=True)
        with self._writing(), begin as txn:
            digests = selected_identities(txn, t, selector)
            if selector.older_than_s is None:
                roots = [child for d in digests for child in children_of(txn, t, d)]
            else:
                roots = idle_blocks(txn, t, set(digests), cutoff)
            before = counters.read_all(txn, t.counters)
            if dry_run:
                blocks, payload, stored = subtree_totals(txn, t, roots)
            else:
                reported = 0
                for n, root in enumerate(roots, 1):
                    self._remove_subtree(txn, root, reason=reason)
                    if progress is not None and (n % 1024 == 0 or n == len(roots)):
                        progress(n - reported)
                        reported = n
                if selector.older_than_s is None:
                    for digest in digests:
                        txn.delete(digest, db=t.identities)
                after = counters.read_all(txn, t.counters)
                blocks, payload, stored = (
                    before[name] - after[name]
                    for name in (counters.BLOCKS, counters.PAYLOAD_BYTES, counters.STORED_BYTES)
                )
        identities = len(digests) if selector.older_than_s is None else 0
        if not dry_run and blocks:
            log.info("purged %d block(s) of %d identity(ies)", blocks, identities)
        return PurgeReport(
            identities,
            blocks,
            payload,
            stored,
            dry_run,
            round(time.perf_counter() - started, 6),
            tuple(digests) if selector.older_than_s is None and not dry_run else (),
        )

    # --- reading -------------------------------------------------------------------------------

    @_pages_checked
    def longest_prefix(
        self, identity: Identity, token_ids: TokenIds, *, hashes: bytes | None = None
    ) -> PrefixMatch:
        """The longest run of stored blocks from the first, compared token by token.

        Stops at the first missing block, even if later blocks exist; a stored block whose tokens,
        parent or identity differ from the query's (a hash collision) is a miss and is counted.
        Payloads are not read: `load`/`read_into` verify them. `hashes` are the blocks' chain
        hashes packed back to back, when the caller already has them (see `BlockChain`).
        """
        self._check_usable()
        identity, hashes = self._namespace(identity, hashes)
        _require_plain(identity, "lookup_state")
        chain = BlockChain(identity, token_ids, hashes)
        with self._env.begin(buffers=True) as txn:
            walk = self._walk(txn, chain, chain.n_blocks)
        self._after_walk(walk, chain)
        with self._lock:
            self._activity.lookups += 1
            self._activity.hit_blocks += len(walk.hashes)
        return PrefixMatch(
            identity.digest, identity.block_tokens, tuple(walk.hashes), tuple(walk.payload_sizes)
        )

    def cached_prefix(
        self, identity: Identity, token_ids: TokenIds, *, hashes: bytes | None = None
    ) -> PrefixMatch | None:
        """`longest_prefix`'s answer when memory alone gives it: every closed block of the query
        lies in a prefix verified earlier that no removal has touched since. Reads no record (only
        the removal epoch, on a page every write touches), so an event loop may call it; None
        means: ask `longest_prefix`."""
        self._check_usable()
        identity, hashes = self._namespace(identity, hashes)
        _require_plain(identity, "lookup_state")
        tokens = as_token_array(token_ids)  # a view: this answer is never remembered
        n_blocks = len(tokens) // identity.block_tokens
        if hashes is not None and len(hashes) != n_blocks * HASH_BYTES:
            raise TokenError(f"{len(hashes)} bytes of block hashes for {n_blocks} closed blocks")
        closed = tokens[: n_blocks * identity.block_tokens]
        if not closed.size:
            return None
        try:
            with self._env.begin(buffers=True) as txn:
                epoch = counters.read(txn, self._tables.counters, counters.REMOVALS)
        except lmdb.Error:
            return None  # a damaged page: `longest_prefix` reports it
        known = self._verified.find_whole(
            identity.digest, closed, epoch, self._min_created_ns(identity)
        )
        if known is None:
            return None
        self._touch(known.hashes)
        with self._lock:
            self._activity.lookups += 1
            self._activity.hit_blocks += len(known.hashes)
        return PrefixMatch(
            identity.digest, identity.block_tokens, known.hashes, known.payload_sizes
        )

    @_pages_checked
    def read_into(self, match: PrefixMatch, dests: Sequence[Any]) -> ReadResult:
        """Verify block i's payload and write it into `dests[i]`, in order, copying once.

        Only the first `n_blocks` of the result were verified; the block after them is a miss (it
        vanished, or failed verification and was quarantined with everything below it). Destination
        bytes of a failed block are zeroed, never left half-written with unverified data.
        """
        self._check_usable()
        hashes, sizes = match.hashes, match.payload_sizes
        if len(dests) != len(hashes):
            raise DestinationError(f"{len(hashes)} blocks but {len(dests)} destinations")
        views = [_dest_view(d, size, i) for i, (size, d) in enumerate(zip(sizes, dests))]
        bad: list[_Damaged] = []
        digest = match.identity_digest
        parents = [digest, *hashes]
        with self._env.begin(buffers=True) as txn:
            min_created = self._min_created_for(txn, digest)
            items: list[StoredPayload] = []
            for h, size, dest, parent in zip(hashes, sizes, views, parents):
                item = self._gather(txn, h, parent, digest, size, dest, bad, min_created)
                if item is None:
                    break
                items.append(item)
            n_ok = self._codec.decode_verified(items, self._pool)
            if n_ok < len(items):
                bad.append(_Damaged(hashes[n_ok], parents[n_ok], digest, _BAD_PAYLOAD))
            items.clear()
        self._quarantine(bad)
        self._touch(hashes[:n_ok])
        verified = sizes[:n_ok]
        with self._lock:
            self._activity.loaded_blocks += n_ok
            self._activity.loaded_bytes += sum(verified)
        return ReadResult(n_ok, verified)

    @_pages_checked
    def load(
        self,
        identity: Identity,
        token_ids: TokenIds,
        out: Any,
        *,
        max_blocks: int | None = None,
        hashes: bytes | None = None,
        first_block: int = 0,
    ) -> LoadResult:
        """Find the longest prefix and write its verified payloads back to back into `out`.

        Loads as many blocks from `first_block` on as fit in `out` (and at most `max_blocks`), in
        one read transaction; the result says how many tokens the caller may skip. A caller that
        streams a long prefix through a small buffer asks for it piece by piece with `first_block`.
        """
        if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
            raise PayloadError(f"first_block must be a non-negative int, got {first_block!r}")
        self._check_usable()
        identity, hashes = self._namespace(identity, hashes)
        _require_plain(identity, "load_state")
        chain = BlockChain(identity, token_ids, hashes)
        limit = chain.n_blocks
        if max_blocks is not None:
            limit = max(0, min(first_block + max_blocks, chain.n_blocks))
        buffer = _dest_view(out, 0, None)
        bad: list[_Damaged] = []
        offsets: list[int] = []
        min_created = self._min_created_ns(identity)
        with self._env.begin(buffers=True) as txn:
            walk = self._walk(txn, chain, limit)
            items: list[StoredPayload] = []
            parents = [identity.digest, *walk.hashes]
            offset = next_size = 0
            start = min(first_block, len(walk.hashes))
            for h, size, parent in zip(
                walk.hashes[start:], walk.payload_sizes[start:], parents[start:]
            ):
                end = offset + size
                if end > buffer.nbytes:
                    if self._damaged_record(txn, h):  # a damaged size is no reason to stop
                        bad.append(_Damaged(h, parent, identity.digest, _BAD_RECORD))
                    else:
                        next_size = size
                    break
                item = self._gather(
                    txn, h, parent, identity.digest, size, buffer[offset:end], bad, min_created
                )
                if item is None:
                    break
                items.append(item)
                offsets.append(offset)
                offset = end
            n_ok = self._codec.decode_verified(items, self._pool)
            if n_ok < len(items):
                next_size = 0  # stopped at a damaged payload, not for room
                failed = start + n_ok
                bad.append(
                    _Damaged(walk.hashes[failed], parents[failed], identity.digest, _BAD_PAYLOAD)
                )
            items.clear()
        self._after_walk(walk, chain)
        self._quarantine(bad)
        sizes = tuple(walk.payload_sizes[start : start + n_ok])
        with self._lock:
            self._activity.lookups += 1
            self._activity.hit_blocks += len(walk.hashes)
            self._activity.loaded_blocks += n_ok
            self._activity.loaded_bytes += sum(sizes)
        return LoadResult(
            n_ok,
            (start + n_ok) * chain.block_tokens,
            tuple(offsets[:n_ok]),
            sizes,
            start,
            next_size,
        )

    def hottest(self, budget_bytes: int, *, tenant: str, limit: int = 64) -> list[HotPrefix]:
        """The tenant's most valuable stored prefixes, by eviction score, whose payloads fit in
        `budget_bytes` (see prefixd.store.warmup): what to bring back first after a restart. A
        tenant of a share group gets the group's prefixes, named with its own identity."""
        self._check_usable()
        if tenant.startswith(SHARE_PREFIX):
            raise IdentityError("tenant", f"names starting with {SHARE_PREFIX!r} are reserved")
        self.sync()  # the reads still counted in memory weigh too
        group = self._share_group.get(tenant)
        stored_as = tenant if group is None else SHARE_PREFIX + group
        with self._env.begin() as txn:
            found = hottest_prefixes(
                txn, self._tables, self._clock.time_ns(), budget_bytes, limit, stored_as
            )
        if group is None:
            return found
        return [
            dataclasses.replace(p, identity=dataclasses.replace(p.identity, tenant=tenant))
            for p in found
        ]

    # --- hybrid identities: state groups ------------------------------------------------------

    def put_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        *,
        paged: Mapping[str, Sequence[Any]] | None = None,
        checkpoints: Mapping[str, Mapping[int, Any]] | None = None,
        upto_tokens: int | None = None,
        first_block: int = 0,
    ) -> PutResult:
        """Publish the state of a hybrid identity's prefix, every group in one transaction.

        Publishes blocks `first_block .. upto_tokens / block_tokens - 1` (`upto_tokens` defaults
        to every token given) with `paged[group]`: one payload per page starting in that range;
        and `checkpoints[group]`: boundary (a token count) -> payload, at boundaries of this put's
        blocks or of blocks already stored (a checkpoint attaches only to a stored boundary of the
        same chain). Refused whole, with nothing written: state that is not closed (OpenTailError),
        payloads that do not match the spec or its policies (PayloadError), and everything `put`
        refuses."""
        self._check_usable()
        if isinstance(first_block, bool) or not isinstance(first_block, int) or first_block < 0:
            raise PayloadError(f"first_block must be a non-negative int, got {first_block!r}")
        identity, _ = self._namespace(identity, None)
        spec = _require_hybrid(identity, "put")
        chain = BlockChain(identity, token_ids)
        bt = chain.block_tokens
        upto = len(chain.tokens) if upto_tokens is None else upto_tokens
        if (
            isinstance(upto, bool)
            or not isinstance(upto, int)
            or not 0 <= upto <= len(chain.tokens)
        ):
            raise PayloadError(
                f"upto_tokens must be an int in 0..{len(chain.tokens)}, got {upto!r}"
            )
        if upto % bt:
            raise OpenTailError(
                f"{upto} tokens end inside block {upto // bt} ({upto % bt} of {bt} tokens): only "
                "closed blocks are stored"
            )
        end = upto // bt
        if first_block > end:
            raise PayloadError(f"first_block {first_block} is past the put's last block {end - 1}")
        planned = plan_put(spec, bt, first_block, end, paged or {}, checkpoints or {})
        encoded = self._codec.encode_many([part.view for part in planned], self._pool)
        return self._publish(
            lambda: self._put_state_txn(chain, first_block, end, planned, encoded),
            identity.tenant,
        )

    def _put_state_txn(
        self,
        chain: BlockChain,
        first_block: int,
        end: int,
        planned: list[PlannedPart],
        encoded: list[EncodedPayload],
    ) -> tuple[PutResult, int]:
        t = self._tables
        assert t.parts is not None
        digest = chain.identity.digest
        now = self._clock.time_ns()
        stored = existed = replaced = parts = 0
        payload_bytes = stored_bytes = 0
        min_created = self._min_created_ns(chain.identity)
        with self._env.begin(write=True) as txn:
            self._check_ancestry(txn, chain, first_block, min_created)
            txn.put(digest, chain.identity.encode(), db=t.identities, overwrite=False)
            for index in range(first_block, end):
                present, dropped = self._claim_block(txn, chain, index, min_created)
                replaced += dropped
                if present:
                    existed += 1
                else:
                    self._write_block(txn, chain, index, None, now)
                    stored += 1
            for part, payload in zip(planned, encoded):
                key = part_key(chain.hash(part.block_index), part.group)
                if txn.get(key, db=t.parts) is not None:
                    continue  # a part is written once, like a block
                record = PartRecord(
                    payload.compression,
                    part.group,
                    part.block_index,
                    payload.chunk_bytes,
                    len(payload.chunks),
                    payload.checksum,
                    payload.payload_size,
                    payload.stored_size,
                    now,
                )
                txn.put(key, record.encode(), db=t.parts)
                _put_chunks(txn, t, key, payload.chunks)
                parts += 1
                payload_bytes += payload.payload_size
                stored_bytes += payload.stored_size
            counters.add(txn, t.counters, counters.BLOCKS, stored)
            counters.add(txn, t.counters, counters.PARTS, parts)
            counters.add(txn, t.counters, counters.PAYLOAD_BYTES, payload_bytes)
            counters.add(txn, t.counters, counters.STORED_BYTES, stored_bytes)
            counters.add(txn, t.counters, counters.identity_stored(digest), stored_bytes)
            counters.add(txn, t.counters, counters.identity_blocks(digest), stored)
        hashes = tuple(chain.hash(i) for i in range(first_block, end))
        return PutResult(stored, existed, hashes, parts), replaced

    @_pages_checked
    def lookup_state(
        self, identity: Identity, token_ids: TokenIds, *, hashes: bytes | None = None
    ) -> JointMatch:
        """The longest boundary at which every state group of a hybrid identity is complete,
        with where to replay from and the payloads to load (see prefixd.store.joint). Reads part
        records, not payloads: `load_state` verifies those."""
        self._check_usable()
        identity, hashes = self._namespace(identity, hashes)
        spec = _require_hybrid(identity, "longest_prefix")
        chain = BlockChain(identity, token_ids, hashes)
        damaged: list[bytes] = []
        with self._env.begin(buffers=True) as txn:
            walk = self._walk(txn, chain, chain.n_blocks)
            match = self._joint(txn, spec, chain, walk.hashes, damaged)
        self._after_walk(walk, chain)
        self._quarantine(self._damaged_parts(damaged, chain, walk.hashes))
        with self._lock:
            self._activity.lookups += 1
            self._activity.hit_blocks += len(match.hashes)
        return match

    @_pages_checked
    def load_state(
        self,
        identity: Identity,
        token_ids: TokenIds,
        out: Any,
        *,
        hashes: bytes | None = None,
    ) -> StateLoad:
        """Find the joint prefix and write every payload it needs, verified, back to back into
        `out` (in `match.parts` order), in one read transaction. A payload that fails
        verification is quarantined with its block and everything below it, and the answer is
        worked out again: what comes back is always a consistent boundary, possibly an earlier
        one. DestinationError if `out` cannot hold the payloads."""
        self._check_usable()
        identity, hashes = self._namespace(identity, hashes)
        spec = _require_hybrid(identity, "load")
        chain = BlockChain(identity, token_ids, hashes)
        buffer = _dest_view(out, 0, None)
        while True:
            damaged: list[bytes] = []
            with self._env.begin(buffers=True) as txn:
                walk = self._walk(txn, chain, chain.n_blocks)
                match = self._joint(txn, spec, chain, walk.hashes, damaged)
                if not damaged:
                    offsets = self._read_parts(txn, spec, match, buffer, damaged)
            self._after_walk(walk, chain)
            if not damaged:
                break
            self._quarantine(self._damaged_parts(damaged, chain, walk.hashes))
        with self._lock:
            self._activity.lookups += 1
            self._activity.hit_blocks += len(match.hashes)
            self._activity.loaded_blocks += len(match.hashes)
            self._activity.loaded_bytes += match.payload_bytes
        return StateLoad(match, offsets)

    def _joint(
        self,
        txn: lmdb.Transaction,
        spec: StateSpec,
        chain: BlockChain,
        found: Sequence[bytes],
        damaged: list[bytes],
    ) -> JointMatch:
        assert self._tables.parts is not None
        identity = chain.identity
        return joint_match(
            txn, self._tables.parts, spec, identity.digest, identity.block_tokens, found, damaged
        )

    def _read_parts(
        self,
        txn: lmdb.Transaction[memoryview],
        spec: StateSpec,
        match: JointMatch,
        buffer: memoryview,
        damaged: list[bytes],
    ) -> tuple[int, ...]:
        """Verify and copy every part of `match` into `buffer`; blocks whose part fails go to
        `damaged` (and the destination bytes from the failure on are zeroed)."""
        t = self._tables
        assert t.parts is not None
        needed = match.payload_bytes
        if needed > buffer.nbytes:
            raise DestinationError(
                f"output buffer holds {buffer.nbytes} bytes, the state needs {needed}"
            )
        groups = {group.name: gi for gi, group in enumerate(spec)}
        items: list[StoredPayload] = []
        offsets: list[int] = []
        offset = 0
        for part in match.parts:
            key = part_key(part.block, groups[part.group])
            raw = txn.get(key, db=t.parts)
            record: PartRecord | None = None
            chunks: list[memoryview | None] | None = None
            if raw is not None:
                try:
                    record = PartRecord.decode(raw)
                except CorruptRecordError:
                    record = None
                if record is not None and record.payload_size == part.payload_size:
                    chunks = [
                        txn.get(chunk_key(key, n), db=t.chunks) for n in range(record.n_chunks)
                    ]
            if (
                record is None
                or chunks is None
                or not chunks_present(chunks)
                or (sum(c.nbytes for c in chunks) != record.stored_size)
            ):
                damaged.append(part.block)
                return ()
            end = offset + part.payload_size
            items.append(StoredPayload(record, chunks, buffer[offset:end]))
            offsets.append(offset)
            offset = end
        n_ok = self._codec.decode_verified(items, self._pool)
        items.clear()
        if n_ok < len(match.parts):
            damaged.append(match.parts[n_ok].block)
            return ()
        return tuple(offsets)

    def _damaged_parts(
        self, damaged: list[bytes], chain: BlockChain, found: Sequence[bytes]
    ) -> list[_Damaged]:
        """The blocks whose parts failed verification, for `_quarantine`: dropping a block drops
        everything below it, so the joint entry is unreachable from that boundary on."""
        index = {h: i for i, h in enumerate(found)}
        digest = chain.identity.digest
        out = []
        for h in dict.fromkeys(damaged):
            i = index[h]
            parent = found[i - 1] if i else digest
            out.append(_Damaged(h, parent, digest, _BAD_PART))
        return out

    @_pages_checked
    def export_block(self, block: bytes) -> ExportedBlock | None:
        """A stored block's record and verified payload, as bytes, to publish it elsewhere;
        None if it is not stored (or fails verification, and is quarantined)."""
        self._check_usable()
        bad: list[_Damaged] = []
        with self._env.begin(buffers=True) as txn:
            raw = txn.get(block, db=self._tables.blocks)
            if raw is None:
                return None
            try:
                record = BlockRecord.decode(raw)
            except CorruptRecordError:
                return None
            out = bytearray(record.payload_size)
            parent_key = _parent_key(record.identity, record.parent)
            item = self._gather(
                txn, block, parent_key, record.identity, record.payload_size, memoryview(out), bad
            )
            verified = item is not None and self._codec.decode_verified([item], self._pool) == 1
            if item is not None and not verified:
                bad.append(_Damaged(block, parent_key, record.identity, _BAD_PAYLOAD))
            record_bytes = bytes(raw)
        self._quarantine(bad)
        return ExportedBlock(record_bytes, bytes(out)) if verified else None

    @_pages_checked
    def block_info(self, block: bytes) -> BlockInfo | None:
        """What the store keeps about one block, or None if it is not stored (or damaged)."""
        self._check_usable()
        t = self._tables
        with self._env.begin() as txn:
            raw = txn.get(block, db=t.blocks)
            access = txn.get(block, db=t.access)
        if raw is None:
            return None
        try:
            record = BlockRecord.decode(raw)
        except CorruptRecordError:
            return None
        with self._lock:
            self._touched = self._take_touches()
            pending_at, pending_hits = self._touched.get(block, (0, 0))
        stored = AccessRecord.read(access, record.created_ns)
        return BlockInfo(
            block,
            record.parent,
            record.identity,
            record.n_tokens,
            record.payload_size,
            record.stored_size,
            record.compression.name.lower().replace("_", "-"),
            record.created_ns,
            max(stored.last_ns, pending_at),
            stored.hits + pending_hits,
        )

    # --- maintenance ---------------------------------------------------------------------------

    def sync(self) -> None:
        """Write pending access times and counters, then fsync the environment."""
        self._check_usable()
        with self._lock:
            touched = self._take_touches()
            collisions, self._pending_collisions = self._pending_collisions, 0
        t = self._tables
        # In batches, in key order: a write transaction holds a copy of every page it dirties,
        # and the allocator keeps that memory (see prefixd.store.allocator), so one transaction
        # over the accesses of a large store would grow the process by most of its access table.
        pending = sorted(touched.items())
        try:
            for start in range(0, max(1, len(pending)), _ACCESS_BATCH):
                with self._env.begin(write=True) as txn:
                    for h, (at, hits) in pending[start : start + _ACCESS_BATCH]:
                        raw = txn.get(h, db=t.access)
                        if raw is None:  # removed since: an access entry lives as its block does
                            continue
                        old = AccessRecord.read(raw, 0)
                        new = AccessRecord(max(old.last_ns, at), old.hits + hits)
                        txn.put(h, new.encode(), db=t.access)
                    if start == 0:
                        counters.add(txn, t.counters, counters.COLLISIONS, collisions)
        except lmdb.Error as exc:  # a full map or disk: the times are a hint, not data
            log.warning("%d access times not recorded: %s", len(touched), exc)
        try:
            self._env.sync(True)
        except lmdb.Error as exc:
            log.warning("fsync of the store failed: %s", exc)

    def compact_to(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Write a compacted copy of the store (free pages dropped) into an empty `directory`.
        The copy is a consistent snapshot; the store itself is not changed."""
        self._check_usable()
        target = Path(directory)
        if target.exists() and any(target.iterdir()):
            raise StoreOpenError(f"{target} is not empty")
        target.mkdir(mode=0o750, parents=True, exist_ok=True)
        self.sync()
        self._env.copy(str(target), compact=True)
        before = (self.path / "data.mdb").stat().st_size
        after = (target / "data.mdb").stat().st_size
        return {
            "from": str(self.path),
            "to": str(target),
            "bytes_before": before,
            "bytes_after": after,
        }

    @_pages_checked
    def stats(self) -> StoreStats:
        """Persisted totals plus this process's activity and codec speeds."""
        self._check_usable()
        t = self._tables
        with self._env.begin() as txn:
            totals = counters.read_all(txn, t.counters)
            n_identities = txn.stat(t.identities)["entries"]
        info = self._env.info()
        used = (info["last_pgno"] + 1) * self._env.stat()["psize"]
        with self._lock:
            activity = _Activity(**vars(self._activity))
            pending_collisions = self._pending_collisions
        c = self._codec.counters
        payload = totals[counters.PAYLOAD_BYTES]
        stored = totals[counters.STORED_BYTES]
        return StoreStats(
            blocks=totals[counters.BLOCKS],
            parts=totals[counters.PARTS],
            copy_verify_gbps=c.copied_bytes / c.copy_s / 1e9 if c.copy_s else 0.0,
            payload_bytes=payload,
            stored_bytes=stored,
            identities=n_identities,
            quarantined=totals[counters.QUARANTINED],
            collisions=totals[counters.COLLISIONS] + pending_collisions,
            map_size=info["map_size"],
            map_used_bytes=used,
            compression_ratio=payload / stored if stored else 1.0,
            lookups=activity.lookups,
            hit_blocks=activity.hit_blocks,
            loaded_blocks=activity.loaded_blocks,
            loaded_bytes=activity.loaded_bytes,
            verify_failures=c.verify_failures,
            compress_gbps=c.compress_in_bytes / c.compress_s / 1e9 if c.compress_s else 0.0,
            decompress_gbps=c.decompress_out_bytes / c.decompress_s / 1e9
            if c.decompress_s
            else 0.0,
            compressed_payloads_stored_raw=c.stored_raw_after_trial,
        )

    @_pages_checked
    def check(
        self,
        *,
        verify_payloads: bool = True,
        progress: Callable[[int], None] | None = None,
    ) -> list[Problem]:
        """Every inconsistency in the store (not just the first); an empty list means healthy.
        Runs in one read transaction: writers go on meanwhile (LMDB readers see a snapshot)."""
        self._check_usable()
        with self._env.begin(buffers=True) as txn:
            return check_store(
                txn, self._tables, verify_payloads=verify_payloads, progress=progress
            )

    def repair(
        self,
        problems: Sequence[Problem] | None = None,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> RepairReport:
        """Check (unless given the `problems` a check found), then quarantine every block a
        problem condemns (with everything below it) and rebuild the indexes and counters from
        the remaining records, in one transaction; report what was found, what was done, and
        whatever still fails a check afterwards."""
        if problems is None:
            problems = self.check(progress=progress)
        condemned = {
            p.block: p.kind for p in problems if p.kind in BLOCK_PROBLEMS and p.block is not None
        }
        quarantined = 0
        with self._env.begin(write=True) as txn:
            for block, kind in condemned.items():
                if txn.get(block, db=self._tables.blocks) is None:
                    continue  # e.g. a part hung on no block: the rebuild drops it
                quarantined += self._remove_subtree(txn, block, reason="quarantined")
                self._record_quarantine(txn, block, f"verify: {kind} problem")
            rebuilt = rebuild_derived(txn, self._tables, self._clock.time_ns())
        if quarantined or rebuilt.total:
            log.warning(
                "repair quarantined %d block(s) and fixed %d index or counter entries",
                quarantined,
                rebuilt.total,
            )
        return RepairReport(len(problems), quarantined, rebuilt.total, tuple(self.check()))

    def close(self) -> None:
        """Flush, fsync and close; idempotent. Only the opening process may close the environment."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True
            return
        self._syncer.stop()
        try:
            self.sync()
        finally:
            self._closed = True
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._env.close()
            if self._owner is not None:
                self._owner.release()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store at {self.config.path} is closed")
        if os.getpid() != self._pid:
            raise StoreClosedError("store was opened in another process; open it again after fork")

    def _walk(self, txn: lmdb.Transaction, chain: BlockChain, limit: int) -> Walk:
        """`walk_chain`, starting after the longest prefix verified earlier (and still valid)."""
        epoch = counters.read(txn, self._tables.counters, counters.REMOVALS)
        min_created = self._min_created_ns(chain.identity)
        known = self._verified.find(chain, epoch, limit, min_created)
        start = None
        if known is not None:
            start = Walk(
                list(known.hashes),
                list(known.payload_sizes),
                oldest_created_ns=known.oldest_created_ns,
            )
        walk = walk_chain(txn, self._tables.blocks, chain, limit, start, min_created)
        if walk.corrupt is None and len(walk.hashes) > (len(known.hashes) if known else 0):
            self._verified.remember(
                chain, epoch, walk.hashes, walk.payload_sizes, walk.oldest_created_ns
            )
        return walk

    def _namespace(self, identity: Identity, hashes: bytes | None) -> tuple[Identity, bytes | None]:
        """The identity entries are stored under: a tenant of a share group stores and finds
        them under the group's namespace (and its own chain hashes do not apply there)."""
        if identity.tenant.startswith(SHARE_PREFIX):
            raise IdentityError("tenant", f"names starting with {SHARE_PREFIX!r} are reserved")
        group = self._share_group.get(identity.tenant)
        if group is None:
            return identity, hashes
        shared = self._shared.get(identity)
        if shared is None:
            shared = dataclasses.replace(identity, tenant=SHARE_PREFIX + group)
            self._shared[identity] = shared
        return shared, None

    def _min_created_ns(self, identity: Identity) -> int:
        """Blocks created before this are past the tenant's time to live (0: no limit)."""
        return self._ttl_cutoff_ns(identity.tenant, self._clock.time_ns())

    def _ttl_cutoff_ns(self, tenant: str, now_ns: int) -> int:
        ttl = self._ttl_s.get(tenant)
        return now_ns - int(ttl * 1e9) if ttl else 0

    def _min_created_for(self, txn: lmdb.Transaction, digest: bytes) -> int:
        """`_min_created_ns` of the identity with this digest, as `txn` sees it."""
        if not self._ttl_s:
            return 0
        return self._ttl_cutoff_ns(self._tenants.tenant_of(txn, digest) or "", self._clock.time_ns())

    def reclaim_expired(self) -> int:
        """Remove the blocks past their tenant's time to live (already unreachable: lookups and
        loads skip them); return how many went."""
        self._check_usable()
        if not self._ttl_s:
            return 0
        now = self._clock.time_ns()
        t = self._tables
        removed = 0
        with self._env.begin(write=True) as txn:
            expired = []
            for key, raw in txn.cursor(db=t.blocks):
                try:
                    record = BlockRecord.decode(raw)
                except CorruptRecordError:
                    continue
                tenant = self._tenants.tenant_of(txn, record.identity) or ""
                cutoff = self._ttl_cutoff_ns(tenant, now)
                if record.created_ns < cutoff:
                    expired.append(bytes(key))
            for block in expired:
                removed += self._remove_subtree(txn, block, reason="expired")
        if removed:
            log.info("reclaimed %d expired block(s)", removed)
        return removed

    def _gather(
        self,
        txn: lmdb.Transaction[memoryview],
        h: bytes,
        parent_key: bytes,
        identity_digest: bytes,
        payload_size: int,
        dest: memoryview,
        bad: list[_Damaged],
        min_created_ns: int = 0,
    ) -> StoredPayload | None:
        """The verified record and chunk views of block `h`, or None if it cannot be read."""
        raw = txn.get(h, db=self._tables.blocks)
        if raw is None:
            return None
        try:
            record = BlockRecord.decode(raw)
        except CorruptRecordError:
            bad.append(_Damaged(h, parent_key, identity_digest, _BAD_RECORD))
            return None
        if record.identity != identity_digest or record.payload_size != payload_size:
            return None
        if record.created_ns < min_created_ns:
            return None  # past its tenant's time to live since it was found
        chunks_db = self._tables.chunks
        chunks: list[memoryview] = []
        for n in range(record.n_chunks):
            chunk = txn.get(chunk_key(h, n), db=chunks_db)
            if chunk is None:
                bad.append(_Damaged(h, parent_key, identity_digest, "payload chunk missing"))
                return None
            chunks.append(chunk)
        if sum(c.nbytes for c in chunks) != record.stored_size:
            bad.append(
                _Damaged(h, parent_key, identity_digest, "payload size differs from its record")
            )
            return None
        return StoredPayload(record, chunks, dest)

    def _damaged_record(self, txn: lmdb.Transaction, h: bytes) -> bool:
        raw = txn.get(h, db=self._tables.blocks)
        if raw is None:
            return False
        try:
            BlockRecord.decode(raw)
        except CorruptRecordError:
            return True
        return False

    def _after_walk(self, walk: Walk, chain: BlockChain) -> None:
        if walk.collided:
            with self._lock:
                self._pending_collisions += 1
        damaged = _damaged_record(walk, chain)
        if damaged is not None:
            self._quarantine([damaged])
        self._touch(walk.hashes)

    def _touch(self, hashes: Sequence[bytes]) -> None:
        """Note an access; runs of blocks are kept whole (keyed by their last block) and spread
        over the blocks only when written, so a repeated long lookup costs one dict entry."""
        if hashes:
            now = self._clock.time_ns()
            with self._lock:
                _, _, count = self._touched_runs.get(hashes[-1], (None, 0, 0))
                self._touched_runs[hashes[-1]] = (hashes, now, count + 1)

    def _take_touches(self) -> dict[bytes, tuple[int, int]]:
        """Pending (last access, hits) per block, removed from memory (call under the lock)."""
        touched = self._touched
        for hashes, at, count in self._touched_runs.values():
            for h in hashes:
                last, hits = touched.get(h, (0, 0))
                touched[h] = (max(last, at), hits + count)
        self._touched, self._touched_runs = {}, {}
        return touched

    def _quarantine(self, bad: list[_Damaged]) -> None:
        """Drop blocks that failed verification, and everything below them, in one transaction.
        If the disk refuses the write, they stay: they fail verification on every read anyway."""
        if not bad:
            return
        try:
            self._quarantine_txn(bad)
        except lmdb.Error as exc:
            log.warning("could not quarantine %d damaged block(s) now: %s", len(bad), exc)

    def _quarantine_txn(self, bad: list[_Damaged]) -> None:
        with self._env.begin(write=True) as txn:
            for h, parent_key, identity, reason in bad:
                dropped = self._remove_subtree(txn, h, parent_key, identity, reason="quarantined")
                if dropped:
                    self._record_quarantine(txn, h, reason)
                    log.warning(
                        "quarantined a stored block (%s); %d block(s) with it", reason, dropped
                    )

    def _record_quarantine(self, txn: lmdb.Transaction, h: bytes, reason: str) -> None:
        t = self._tables
        entry = msgpack.packb({"at_ns": self._clock.time_ns(), "reason": reason})
        txn.put(h, entry, db=t.quarantine)
        counters.add(txn, t.counters, counters.QUARANTINED, 1)

    def _remove_subtree(
        self,
        txn: lmdb.Transaction,
        root: bytes,
        root_parent_key: bytes | None = None,
        root_identity: bytes | None = None,
        *,
        reason: str,
    ) -> int:
        """Delete `root` and its descendants (records, chunks, index entries, counters), and
        count them per tenant under `reason` (see `removals`).

        `root_parent_key` and `root_identity` stand in for what the root's record says when it
        is too damaged to say it (its place in the children index, its identity's byte count)."""
        t = self._tables
        removed = payload_bytes = stored_bytes = parts_removed = 0
        by_identity: dict[bytes, int] = {}
        blocks_of: Counter[bytes] = Counter()
        stack = [root]
        children = txn.cursor(db=t.children)
        while stack:
            h = stack.pop()
            raw = txn.get(h, db=t.blocks)
            if raw is None:
                continue
            if children.set_key(h):
                stack.extend(bytes(child) for child in children.iternext_dup())
                txn.delete(h, db=t.children)
            try:
                record: BlockRecord | None = BlockRecord.decode(raw)
            except CorruptRecordError:
                record = None
            part_payload, n_parts = _delete_parts(txn, t, h)
            freed = _delete_chunks(txn, t, h)
            payload_bytes += part_payload
            parts_removed += n_parts
            txn.delete(h, db=t.blocks)
            txn.delete(h, db=t.access)
            if record is not None:
                txn.delete(_children_key(record), h, db=t.children)
                payload_bytes += record.payload_size
                by_identity[record.identity] = by_identity.get(record.identity, 0) + freed
                blocks_of[record.identity] += 1
            else:
                if h == root and root_parent_key is not None:
                    txn.delete(root_parent_key, h, db=t.children)
                if h == root and root_identity is not None:
                    by_identity[root_identity] = by_identity.get(root_identity, 0) + freed
                    blocks_of[root_identity] += 1
                payload_bytes += freed
            stored_bytes += freed
            removed += 1
        counters.add(txn, t.counters, counters.REMOVALS, 1 if removed else 0)
        counters.add(txn, t.counters, counters.BLOCKS, -removed)
        counters.add(txn, t.counters, counters.PARTS, -parts_removed)
        counters.add(txn, t.counters, counters.PAYLOAD_BYTES, -payload_bytes)
        counters.add(txn, t.counters, counters.STORED_BYTES, -stored_bytes)
        for digest, freed_bytes in by_identity.items():
            counters.add(txn, t.counters, counters.identity_stored(digest), -freed_bytes)
        for digest, blocks in blocks_of.items():
            counters.add(txn, t.counters, counters.identity_blocks(digest), -blocks)
            self._tally_removal(txn, digest, reason, blocks)
        return removed

    def _tally_removal(
        self, txn: lmdb.Transaction, digest: bytes, reason: str, blocks: int
    ) -> None:
        """Count removed blocks per tenant and reason, in memory (after the write commits, the
        count may run ahead of a transaction that aborted: it is a rate, not an inventory)."""
        tenant = self._tenants.tenant_of(txn, digest) or ""
        with self._lock:
            self._removals[tenant, reason] += blocks

    def removals(self) -> dict[str, dict[str, int]]:
        """Blocks removed since the store was opened, per tenant and reason: evicted,
        quarantined, retired (a model version purged), purged, expired, deleted, replaced."""
        with self._lock:
            tally = dict(self._removals)
        out: dict[str, dict[str, int]] = {}
        for (tenant, reason), blocks in tally.items():
            out.setdefault(tenant, {})[reason] = blocks
        return out

    def tenant_totals(self) -> dict[str, dict[str, int]]:
        """Stored blocks and bytes per tenant (from the per-identity counters)."""
        totals: dict[str, dict[str, int]] = {}
        with self._env.begin() as txn:
            stored = counters.read_prefixed(txn, self._tables.counters, counters.IDENTITY_STORED)
            blocks = counters.read_prefixed(txn, self._tables.counters, counters.IDENTITY_BLOCKS)
            for digest in stored.keys() | blocks.keys():
                n_blocks, n_bytes = blocks.get(digest, 0), stored.get(digest, 0)
                owner = self._tenants.tenant_of(txn, digest)
                if owner is None and not (n_blocks or n_bytes):
                    continue  # the spent counters of a purged identity
                tenant = totals.setdefault(owner or "", {"blocks": 0, "stored_bytes": 0})
                tenant["blocks"] += n_blocks
                tenant["stored_bytes"] += n_bytes
        return totals


def _require_hybrid(identity: Identity, plain_method: str) -> StateSpec:
    if identity.state is None:
        raise IdentityError(
            "state", f"is not set: an identity without state groups uses {plain_method}"
        )
    return identity.state


def _require_plain(identity: Identity, hybrid_method: str) -> None:
    """A hybrid identity's blocks carry no payload of their own; the plain calls would report a
    prefix that no state group backs (a partial hit), so they refuse it."""
    if identity.state is not None:
        raise IdentityError("state", f"is set: an identity with state groups uses {hybrid_method}")


def _children_key(record: BlockRecord) -> bytes:
    """First blocks hang under their identity digest, so an identity's blocks can be enumerated."""
    return _parent_key(record.identity, record.parent)


def _parent_key(identity_digest: bytes, parent: bytes) -> bytes:
    return identity_digest if parent == ROOT_PARENT else parent


def _damaged_record(walk: Walk, chain: BlockChain) -> _Damaged | None:
    """The block whose damaged record ended `walk`, if one did."""
    if walk.corrupt is None:
        return None
    parent = walk.hashes[-1] if walk.hashes else chain.identity.digest
    return _Damaged(walk.corrupt, parent, chain.identity.digest, _BAD_RECORD)


def _put_chunks(txn: lmdb.Transaction, t: Tables, owner: bytes, chunks: Sequence[Any]) -> None:
    """Write a payload's chunks under its owner's key (a block hash or a part key)."""
    for n, chunk in enumerate(chunks):
        txn.put(chunk_key(owner, n), chunk, db=t.chunks)


def _chunk_bytes(txn: lmdb.Transaction, t: Tables, prefix: bytes) -> int:
    """Bytes of the chunks whose keys start with `prefix`."""
    cursor = txn.cursor(db=t.chunks)
    total = 0
    if cursor.set_range(prefix):
        for key, value in cursor:
            if bytes(key[: len(prefix)]) != prefix:
                break
            total += len(value)
    return total


def _delete_chunks(txn: lmdb.Transaction, t: Tables, h: bytes) -> int:
    cursor = txn.cursor(db=t.chunks)
    freed = 0
    if not cursor.set_range(h):
        return 0
    while True:
        key = cursor.key()
        if key[: len(h)] != h:
            break
        freed += len(cursor.value())
        if not cursor.delete():
            break
    return freed


def _delete_parts(txn: lmdb.Transaction, t: Tables, h: bytes) -> tuple[int, int]:
    """Delete the part records hung on block `h` (their chunks go with the block's, by prefix);
    return their payload bytes and how many there were."""
    if t.parts is None:
        return 0, 0
    cursor = txn.cursor(db=t.parts)
    payload = removed = 0
    if not cursor.set_range(h):
        return 0, 0
    while bytes(cursor.key()[: len(h)]) == h:
        try:
            payload += PartRecord.decode(cursor.value()).payload_size
        except CorruptRecordError:  # its size is unknown: count what its chunks hold
            payload += _chunk_bytes(txn, t, bytes(cursor.key()))
        removed += 1
        if not cursor.delete():
            break
    return payload, removed


def _dest_view(buffer: Any, size: int, index: int | None) -> memoryview:
    what = "output buffer" if index is None else f"destination of block {index}"
    try:
        view = memoryview(buffer)
    except TypeError:
        raise DestinationError(f"{what} is a {type(buffer).__name__}, not a byte buffer") from None
    if view.readonly:
        raise DestinationError(f"{what} is read-only")
    if not view.c_contiguous:
        raise DestinationError(f"{what} is not contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if view.nbytes < size:
        raise DestinationError(f"{what} holds {view.nbytes} bytes, the payload needs {size}")
    return view if index is None else view[:size]
