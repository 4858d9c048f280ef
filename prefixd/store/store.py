"""The store: one LMDB environment over the prefix chain, behind one thin facade.

`Store` builds the shared handles (prefixd.store.context) and hands each call to the module
that owns it (docs/architecture.md lists them). Invariants every write transaction keeps:
  * a block is stored only if its whole ancestry is stored and matches the writer's tokens,
    so a stored block is reachable exactly when its prefix is (there are no orphans);
  * a block is written once and never modified; removing a block removes its subtree;
  * records, chunks, the children index and the counters change in the same transaction."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Concatenate, Literal, ParamSpec, Self, TypeVar

from prefixd.clock import Clock, SystemClock
from prefixd.errors import StoreClosedError
from prefixd.schema.chain import chain_hashes
from prefixd.schema.identity import Identity
from prefixd.schema.stored import HotPrefix, ListedBlock
from prefixd.schema.tokens import PromptIds
from prefixd.store import (
    check,
    counters,
    eviction,
    journal,
    listing,
    purge,
    removal,
    repair,
    warmup,
)
from prefixd.store.access import AccessTimes
from prefixd.store.codec import PayloadCodec
from prefixd.store.config import Durability, StoreConfig
from prefixd.store.context import StoreContext
from prefixd.store.direct import DataFile
from prefixd.store.environment import (
    DATA_FILE,
    OwnerLock,
    copy_compacted,
    is_held,
    open_environment,
)
from prefixd.store.fair import FairPool
from prefixd.store.journal import BlockChange, BlockObserver
from prefixd.store.lmdb_errors import lmdb_errors
from prefixd.store.purge import PurgeReport, PurgeSelector
from prefixd.store.put import Writer, check_first_block
from prefixd.store.read import Reader
from prefixd.store.recheck import RecheckReport, recheck
from prefixd.store.results import (
    BlockInfo,
    EvictionReport,
    ExportedBlock,
    JointMatch,
    LoadResult,
    PrefixMatch,
    Problem,
    PutResult,
    ReadResult,
    RepairReport,
    StateLoad,
    StoreStats,
)
from prefixd.store.sync_state import SyncFailure, SyncState
from prefixd.store.syncer import PeriodicSyncer
from prefixd.store.tallies import Tallies
from prefixd.store.tenancy import Tenancy
from prefixd.store.tenants import TenantIndex
from prefixd.store.write_behind import WriteBehind

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _translated(
    doing: str, *, writing: bool = True, check: Literal["writable", "usable", "none"] | None = None
) -> Callable[[Callable[Concatenate[Store, _P], _R]], Callable[Concatenate[Store, _P], _R]]:
    """Run a public method under `lmdb_errors`, so an lmdb.Error leaves the store as the prefixd
    error a caller can act on, after `check` (by default: writable for a write, usable for a read).
    """
    check = check or ("writable" if writing else "usable")

    def wrap(method: Callable[Concatenate[Store, _P], _R]) -> Callable[Concatenate[Store, _P], _R]:
        @functools.wraps(method)
        def run(self: Store, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
            with lmdb_errors(self.config.path, self.config.map_size, doing, writing=writing):
                if check == "writable":
                    self._check_writable()
                elif check == "usable":
                    self._check_usable()
                return method(self, *args, **kwargs)

        return run

    return wrap


class Store:
    """A persistent prefix store in one LMDB environment.

    Open it in the process that uses it (after any fork). Methods are thread-safe; the store must
    not be closed while other threads still call it."""

    def __init__(
        self, config: StoreConfig, *, exclusive: bool = False, clock: Clock | None = None
    ) -> None:
        """`exclusive`: hold the owner lock (a daemon does) so offline tools refuse to run beside
        this process; StoreBusyError if another holds it. `clock`: what ages and times to live are
        read from."""
        self.config = config
        clock = clock or SystemClock()
        env, tables, self.meta = open_environment(config, now_ns=clock.time_ns)
        try:
            self._owner = OwnerLock(config.path) if exclusive else None
            data_file = DataFile(config.path / DATA_FILE, config.read_path)
            full = config.durability is Durability.FULL
            write_behind = WriteBehind(config.path / DATA_FILE, full=full)
        except BaseException:
            env.close()
            raise
        self._pid = os.getpid()
        threads = config.verify_threads
        pool = ThreadPoolExecutor(threads, thread_name_prefix="prefixd-verify") if threads else None
        self._ctx = StoreContext(
            config=config,
            env=env,
            tables=tables,
            meta=self.meta,
            clock=clock,
            codec=PayloadCodec(
                config.compression,
                level=config.zstd_level,
                min_gain=config.min_compression_gain,
                chunk_bytes=config.chunk_bytes,
            ),
            pool=pool,
            tenants=TenantIndex(tables.identities),
            tallies=Tallies(),
            syncs=SyncState(config.path, clock),
            data_file=data_file,
            write_behind=write_behind,
            copier=FairPool(threads, name="prefixd-verify") if threads else None,
        )
        self._tenancy = Tenancy(self._ctx)
        self._access = AccessTimes(self._ctx)
        self._writer = Writer(self._ctx, self._tenancy, self._access)
        self._reader = Reader(self._ctx, self._tenancy, self._access)
        self._closed = False
        try:
            # what this open checked after an earlier run's failed fsync (None: nothing)
            self.rechecked = self._settle(may_recheck=exclusive or not is_held(config.path))
        except BaseException:
            self._closed = True
            self._release()
            raise
        self._syncer = PeriodicSyncer(self._access.sync, config.sync_interval_s)
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

    @property
    def capacity_bytes(self) -> int:
        """The store's capacity in stored bytes: past its high watermark of it, it evicts."""
        return eviction.capacity_bytes(self.config)

    # --- writing -------------------------------------------------------------------------------

    @_translated("the put")
    def put(
        self,
        identity: Identity,
        token_ids: PromptIds,
        payloads: Sequence[Any],
        *,
        first_block: int = 0,
        created_ns: int | None = None,
    ) -> PutResult:
        """Publish blocks `first_block ..` of `token_ids` (the whole prefix from its first token),
        one per payload, atomically. Refused whole, with nothing written: an open block
        (OpenTailError), a missing parent chain (OrphanBlockError), a hash owned by other tokens
        (BlockCollisionError), a bad payload (PayloadError); a full map raises StoreFullError, and
        after a failed fsync every put SyncFailedError. `created_ns`: when the blocks were first
        stored elsewhere (a shared-tier install), never later than now: their time to live counts
        from it."""
        return self._writer.put(identity, token_ids, payloads, first_block, created_ns)

    @_translated("the put")
    def put_state(
        self,
        identity: Identity,
        token_ids: PromptIds,
        *,
        paged: Mapping[str, Sequence[Any]] | None = None,
        checkpoints: Mapping[str, Mapping[int, Any]] | None = None,
        upto_tokens: int | None = None,
        first_block: int = 0,
        created_ns: int | None = None,
    ) -> PutResult:
        """Publish a hybrid identity's state up to `upto_tokens` in one transaction: `paged[group]`
        (one payload per page ending in the put's blocks: a page hangs on its last) and
        `checkpoints[group]` (boundary -> payload, at a stored or put boundary). Refused whole
        like `put`, and for state not closed (OpenTailError) or not matching the spec
        (PayloadError). `created_ns`: as `put`'s."""
        return self._writer.put_state(
            identity,
            token_ids,
            paged or {},
            checkpoints or {},
            upto_tokens,
            first_block,
            created_ns,
        )

    @_translated("the delete")
    def delete(self, hashes: Iterable[bytes]) -> int:
        """Remove the given blocks and every block below them; return how many went."""
        return removal.delete(self._ctx, hashes)

    # --- reading -------------------------------------------------------------------------------

    @_translated("the lookup", writing=False)
    def longest_prefix(
        self, identity: Identity, token_ids: PromptIds, *, hashes: bytes | None = None
    ) -> PrefixMatch:
        """The longest run of stored blocks from the first, compared token by token: it stops at the
        first missing block, and a hash collision is a counted miss. Payloads are not read:
        `load`/`read_into` verify them. `hashes`: the chain hashes packed back to back, when the
        caller has them."""
        return self._reader.longest_prefix(identity, token_ids, hashes)

    @_translated("the lookup", writing=False)
    def pin(
        self, identity: Identity, token_ids: PromptIds, *, hashes: bytes | None = None
    ) -> PrefixMatch:
        """`longest_prefix`, with the answer's blocks held from eviction until `unpin`. The prefix
        is read again after pinning, so a block an eviction round took meanwhile is neither answered
        nor left pinned."""
        found = self._reader.longest_prefix(identity, token_ids, hashes)
        pins = self._ctx.pins
        pins.hold(found.hashes)
        again = self._reader.longest_prefix(identity, token_ids, hashes)
        kept = 0
        for mine, now in zip(found.hashes, again.hashes):
            if mine != now:
                break
            kept += 1
        pins.release(found.hashes[kept:])
        return dataclasses.replace(
            found, hashes=found.hashes[:kept], payload_sizes=again.payload_sizes[:kept]
        )

    def unpin(self, hashes: Iterable[bytes]) -> None:
        self._ctx.pins.release(hashes)

    def namespace(self, identity: Identity) -> Identity:
        """The identity `identity`'s entries are stored under: its share group's (tenant
        `share:GROUP`) when its tenant is in one, else itself. Their records and chain hashes
        name it, so a shared tier keys and proves them by it."""
        return self._tenancy.namespace(identity, None)[0]

    def min_created_ns(self, identity: Identity) -> int:
        """Entries of `identity` created before this (wall clock, ns) are past their tenant's
        time to live (its share group's, when in one): never served; 0 when none is set."""
        return self._tenancy.min_created_ns(self.namespace(identity))

    def chain_of(self, identity: Identity, token_ids: PromptIds) -> list[bytes]:
        """The hashes the closed blocks of `token_ids` are stored under (in the share group's
        namespace when the tenant is in one): what `pin` pinned, what `delete` takes."""
        return chain_hashes(self.namespace(identity), token_ids)

    @_translated("the lookup", writing=False)
    def cached_prefix(
        self, identity: Identity, token_ids: PromptIds, *, hashes: bytes | None = None
    ) -> PrefixMatch | None:
        """`longest_prefix`'s answer when memory alone gives it (a prefix verified earlier that no
        removal has touched since); reads only the removal epoch, so an event loop may call it.
        None: ask `longest_prefix`."""
        matches = self.cached_prefixes(identity, [(token_ids, hashes)])
        return None if matches is None else matches[0]

    @_translated("the lookup", writing=False)
    def cached_prefixes(
        self, identity: Identity, queries: Sequence[tuple[PromptIds, bytes | None]]
    ) -> list[PrefixMatch] | None:
        """`cached_prefix` of each query, all or none: None (and nothing counted) unless memory
        answers every one."""
        return self._reader.cached_prefixes(identity, queries)

    @_translated("the read", writing=False)
    def read_into(self, match: PrefixMatch, dests: Sequence[Any]) -> ReadResult:
        """Verify block i's payload and write it into `dests[i]`, in order, copying once. Only the
        first `n_blocks` verified; a failed block's destination is zeroed, never left half-written.
        """
        return self._reader.read_into(match, dests)

    @_translated("the load", writing=False, check="none")
    def load(
        self,
        identity: Identity,
        token_ids: PromptIds,
        out: Any,
        *,
        max_blocks: int | None = None,
        hashes: bytes | None = None,
        first_block: int = 0,
        deadline: float | None = None,
    ) -> LoadResult:
        """Find the longest prefix and write its verified payloads from `first_block` on, back to
        back, into `out` (as many as fit, at most `max_blocks`), in one read transaction: a long
        prefix streams through a small buffer piece by piece. Past `deadline` (store clock,
        monotonic s) the blocks verified so far answer: a shorter hit."""
        check_first_block(first_block)
        self._check_usable()
        return self._reader.load(
            identity, token_ids, out, max_blocks, hashes, first_block, deadline
        )

    @_translated("the warm-up ranking", writing=False)
    def hottest(self, budget_bytes: int, *, tenant: str, limit: int = 64) -> list[HotPrefix[bytes]]:
        """The tenant's most valuable prefixes whose payloads fit in `budget_bytes`: what to bring
        back first after a restart (prefixd.store.warmup); a share group's tenant gets the group's.
        """
        return warmup.hottest(self._ctx, self._tenancy, self._access, budget_bytes, tenant, limit)

    @_translated("the listing", writing=False)
    def list_blocks(
        self, *, tenant: str, after: bytes | None = None, limit: int = 1024
    ) -> tuple[list[ListedBlock], bytes | None]:
        """A page of the tenant's stored blocks after the cursor `after`, and the next page's cursor
        (None when none follows)."""
        stored_as = self._tenancy.stored_as(tenant)
        return listing.list_blocks(self._ctx, tenant, stored_as, after, limit)

    @_translated("the lookup", writing=False)
    def lookup_state(
        self, identity: Identity, token_ids: PromptIds, *, hashes: bytes | None = None
    ) -> JointMatch:
        """The longest boundary at which every state group of a hybrid identity is complete
        (prefixd.store.joint). Reads part records, not payloads: `load_state` verifies those."""
        return self._reader.lookup_state(identity, token_ids, hashes)

    @_translated("the load", writing=False)
    def load_state(
        self,
        identity: Identity,
        token_ids: PromptIds,
        out: Any,
        *,
        hashes: bytes | None = None,
        deadline: float | None = None,
    ) -> StateLoad:
        """Find the joint prefix and write every payload it needs, verified, back to back into `out`
        (DestinationError if it is too small). A failing payload is quarantined and the answer
        worked out again, so it is always a consistent boundary; past `deadline` it is a miss (a
        state needs every group)."""
        return self._reader.load_state(identity, token_ids, out, hashes, deadline)

    @_translated("the export", writing=False)
    def export_block(self, block: bytes) -> ExportedBlock | None:
        """A stored block's record and verified payload, to publish it elsewhere; None if it is not
        stored (or fails verification, and is quarantined)."""
        return self._reader.export_block(block)

    @_translated("the block lookup", writing=False)
    def block_info(self, block: bytes) -> BlockInfo | None:
        """What the store keeps about one block; None if it is not stored (or damaged)."""
        return self._reader.block_info(block)

    # --- tenants --------------------------------------------------------------------------------

    @_translated("the count", writing=False, check="none")
    def tenant_bytes(self, tenant: str) -> int:
        """Stored bytes of every identity of `tenant` (what its quota limits)."""
        return self._tenancy.tenant_bytes(tenant)

    @_translated("the count", writing=False, check="none")
    def tenant_totals(self) -> dict[str, dict[str, int]]:
        return self._tenancy.tenant_totals()

    def removals(self) -> dict[str, dict[str, int]]:
        """Blocks removed since the store was opened, per tenant and reason (evicted, quarantined,
        retired, purged, expired, deleted, replaced)."""
        return self._ctx.tallies.removals()

    # --- maintenance ---------------------------------------------------------------------------

    @_translated("the eviction")
    def evict(
        self, target_bytes: int | None = None, *, tenant: str | None = None
    ) -> EvictionReport:
        """Evict leaves, lowest value per byte first, down to `target_bytes` (default: the
        capacity's low watermark); with `tenant`, only its blocks and bytes count."""
        return eviction.evict(self._ctx, self._tenancy, self._access, target_bytes, tenant)

    @_translated("the reclaim", check="usable")
    def reclaim_expired(self) -> int:
        """Remove the blocks past their tenant's time to live (lookups already skip them). None go
        after a failed fsync: nothing more is written then, and no caller sees a difference."""
        if self._ctx.syncs.failure is not None:
            return 0
        return eviction.reclaim_expired(self._ctx, self._tenancy)

    @_translated("the purge", check="none")
    def purge(
        self,
        selector: PurgeSelector,
        *,
        dry_run: bool = False,
        progress: Callable[[int], None] | None = None,
        keep_known: bool = False,
    ) -> PurgeReport:
        """Remove what `selector` names in one transaction; in-flight reads keep their snapshot. A
        dry run counts only; `progress` is told how many root blocks each step handled;
        `keep_known`: see prefixd.store.purge.purge."""
        if dry_run:
            self._check_usable()
        else:
            self._check_writable()
        return purge.purge(
            self._ctx,
            self._access,
            selector,
            dry_run=dry_run,
            progress=progress,
            keep_known=keep_known,
        )

    def observe(self, observer: BlockObserver | None) -> None:
        """Tell `observer`, after each commit, which blocks it stored and removed
        (prefixd.store.journal); None stops telling."""
        self._ctx.journals.observer = observer

    def inventory(self, batch: int = 1024) -> Iterator[list[BlockChange]]:
        """Every stored block as STORED changes, in batches each read in a transaction of its own:
        what a restarted daemon announces."""
        self._check_usable()
        ctx, after = self._ctx, b""
        while True:
            found, after = journal.inventory(
                ctx.env, ctx.tables, after, batch, self._tenancy.min_created_for
            )
            if found:
                yield found
            if not after:
                return

    def sync(self) -> None:
        """Write pending access times and counters, then fsync; SyncFailedError if that fsync fails,
        or one did before (it is never retried as if it could succeed)."""
        self._check_usable()
        if not self._access.sync():
            self._ctx.syncs.check_writable()

    @property
    def sync_failure(self) -> SyncFailure | None:
        """The failed fsync that made this store refuse writes, or None."""
        return self._ctx.syncs.failure

    @property
    def last_sync_ns(self) -> int:
        """When (store clock, ns) the last good fsync began; 0 if none did."""
        return self._ctx.syncs.last_good_ns

    @_translated("the compaction", check="usable")
    def compact_to(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Write a compacted, consistent copy of the store into an empty `directory`."""
        self._access.sync()
        return copy_compacted(self._ctx.env, self.path, Path(directory), self.config.map_size)

    @_translated("the stats", writing=False)
    def stats(self) -> StoreStats:
        ctx = self._ctx
        with ctx.env.begin() as txn:
            totals = counters.read_all(txn, ctx.tables.counters)
            n_identities = txn.stat(ctx.tables.identities)["entries"]
        info = ctx.env.info()
        activity = ctx.tallies.activity()
        c = ctx.codec.counters
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
            collisions=totals[counters.COLLISIONS] + ctx.tallies.pending_collisions(),
            map_size=info["map_size"],
            map_used_bytes=(info["last_pgno"] + 1) * ctx.env.stat()["psize"],
            compression_ratio=payload / stored if stored else 1.0,
            lookups=activity.lookups,
            hit_blocks=activity.hit_blocks,
            loaded_blocks=activity.loaded_blocks,
            loaded_bytes=activity.loaded_bytes,
            verify_failures=c.verify_failures,
            compress_gbps=c.compress_in_bytes / c.compress_s / 1e9 if c.compress_s else 0.0,
            decompress_gbps=(
                c.decompress_out_bytes / c.decompress_s / 1e9 if c.decompress_s else 0.0
            ),
            compressed_payloads_stored_raw=c.stored_raw_after_trial,
            destinations_changed=c.destinations_changed,
            file_read_bytes=c.file_read_bytes,
            deadline_cutoffs=c.deadline_cutoffs,
        )

    @_translated("the check", writing=False)
    def check(
        self, *, verify_payloads: bool = True, progress: Callable[[int], None] | None = None
    ) -> list[Problem]:
        """Every inconsistency in the store; empty means healthy. One read transaction: writers go
        on."""
        return check.check(self._ctx, verify_payloads=verify_payloads, progress=progress)

    @_translated("the repair")
    def repair(
        self,
        problems: Sequence[Problem] | None = None,
        *,
        progress: Callable[[int], None] | None = None,
    ) -> RepairReport:
        """Quarantine every block a problem condemns (checking first unless given `problems`) and
        rebuild indexes and counters, in one transaction; report what remains."""
        return repair.repair(self._ctx, problems, progress=progress)

    def apply_tenancy(self, config: StoreConfig) -> None:
        """Take `config`'s share groups, quotas and times to live while open (a daemon's reload);
        its other settings are ignored."""
        self._check_usable()
        self._tenancy.apply(config)

    def record_socket(self, socket: Path) -> None:
        """Note the daemon's socket in the owner lock (a shared store has none)."""
        if self._owner is not None:
            self._owner.record(socket)

    def close(self) -> None:
        """Flush, fsync and close; idempotent, and only in the opening process. SyncFailedError
        (once closed) if this last fsync is the first to fail."""
        if self._closed:
            return
        if os.getpid() != self._pid:
            self._closed = True
            return
        self._syncer.stop()
        syncs = self._ctx.syncs
        failed_before = syncs.failure is not None
        try:
            self._access.sync()
        finally:
            self._closed = True
            self._release()
        if not failed_before:
            syncs.check_writable()

    def _release(self) -> None:
        if self._ctx.pool is not None:
            self._ctx.pool.shutdown(wait=True)
        if self._ctx.copier is not None:
            self._ctx.copier.close()
        self._ctx.env.close()
        self._ctx.data_file.close()
        self._ctx.write_behind.close()
        if self._owner is not None:
            self._owner.release()

    def _settle(self, *, may_recheck: bool) -> RecheckReport | None:
        """At open: recheck the blocks an earlier run's failed fsync left unsure (if this process
        holds the store, or none does), then fsync so the last good sync is known; clear the marker
        once both went well. An open that may not recheck starts in the failed state."""
        syncs = self._ctx.syncs
        inherited = syncs.inherited
        report = None
        if inherited is not None:
            if not may_recheck:
                syncs.adopt(inherited)
                return None
            report = recheck(self._ctx, inherited)
            if not report.complete:
                syncs.fail("the check after a failed sync could not quarantine what failed")
        if syncs.sync(self._ctx.env) and report is not None:
            syncs.clear_marker()
        return report

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _check_writable(self) -> None:
        """Also SyncFailedError once an fsync failed: no write could be promised to stay."""
        self._check_usable()
        self._ctx.syncs.check_writable()

    def _check_usable(self) -> None:
        if self._closed:
            raise StoreClosedError(f"store at {self.config.path} is closed")
        if os.getpid() != self._pid:
            raise StoreClosedError("store was opened in another process; open it again after fork")
