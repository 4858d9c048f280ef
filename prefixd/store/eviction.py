"""Which blocks to evict: leaves only, lowest value per byte first.

Value V = p * C_saved / (M * T) (the design notes), estimated as:
  p / T   ~ (hits + 1) / (residence_s + TAU_S) * exp(-idle_s / IDLE_TAU_S)
  C_saved ~ the block's tokens (its identity's `block_tokens`)
  M       = the block's stored bytes, with its state-group parts

Only leaves are candidates, so a prefix shrinks from its end and what stays is reachable.
Pinned blocks are never candidates; a round that removed a block pinned meanwhile is rolled back
and run again. `lru` (last read alone) exists to compare against."""

from __future__ import annotations

import heapq
import logging
import math
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import lmdb

from prefixd.schema.identity import Identity
from prefixd.schema.records import AccessRecord, BlockRecord
from prefixd.store import counters
from prefixd.store.config import StoreConfig
from prefixd.store.joint import part_bytes
from prefixd.store.removal import remove_subtree
from prefixd.store.results import EvictionReport
from prefixd.store.scrub import clear, tree_pages
from prefixd.store.tables import Tables, children_key, decoded, identity_of, records_after

if TYPE_CHECKING:
    from prefixd.store.access import AccessTimes
    from prefixd.store.context import StoreContext
    from prefixd.store.pins import Pins
    from prefixd.store.tenancy import Tenancy

log = logging.getLogger(__name__)

TAU_S = 300.0
PIN_RETRIES = 4  # rounds rolled back because a victim got pinned, before one gives up
IDLE_TAU_S = 3600.0
# Without a capacity setting, payloads may fill this share of the map: records, indexes and
# LMDB's free pages need the rest.
DEFAULT_CAPACITY_SHARE = 0.8


def capacity_bytes(config: StoreConfig) -> int:
    """The stored bytes the store keeps below its high watermark of (and evicts down from)."""
    return config.capacity_bytes or int(config.map_size * DEFAULT_CAPACITY_SHARE)


class Candidate(NamedTuple):  # a tuple: the heap compares them in C
    score: float
    block: bytes
    parent_key: bytes
    stored_size: int


def value_per_byte(record: BlockRecord, access: AccessRecord, now_ns: int, tokens: int) -> float:
    residence_s = max(0.0, (now_ns - record.created_ns) / 1e9)
    idle_s = max(0.0, (now_ns - access.last_ns) / 1e9)
    rate = (access.hits + 1) / (residence_s + TAU_S) * math.exp(-idle_s / IDLE_TAU_S)
    return rate * tokens / max(1, record.stored_size)


class VictimQueue:
    """Leaves by ascending score; a parent joins once its last child is gone."""

    def __init__(
        self,
        txn: lmdb.Transaction,
        tables: Tables,
        policy: str,
        now_ns: int,
        identities: set[bytes] | None = None,
        pins: Pins | None = None,
    ) -> None:
        """`identities`: only blocks of those are candidates; blocks `pins` holds never are."""
        self._identities = identities
        self._pins = pins
        self._txn = txn
        self._t = tables
        self._policy = policy
        self._now = now_ns
        self._identities_read: dict[bytes, Identity | None] = {}
        self._heap: list[Candidate] = []
        children = txn.cursor(db=tables.children)
        for key, value in txn.cursor(db=tables.blocks):
            block = bytes(key)
            if children.set_key(block):
                continue  # has descendants: not a leaf
            candidate = self._candidate(block, value)
            if candidate is not None:
                self._heap.append(candidate)
        heapq.heapify(self._heap)

    def _candidate(self, block: bytes, raw: bytes | memoryview) -> Candidate | None:
        if self._pins is not None and self._pins.held(block):
            return None  # between a lookup that pinned it and the load that reads it
        record = decoded(raw)
        if record is None:
            return None  # verification quarantines it; eviction leaves it alone
        if self._identities is not None and record.identity not in self._identities:
            return None
        access = AccessRecord.read(self._txn.get(block, db=self._t.access), record.created_ns)
        parent_key = children_key(record)
        # a hybrid identity's block holds its bytes in parts (its record's own payload is empty)
        stored = record.stored_size + part_bytes(self._txn, self._t.parts, block)
        record = record._replace(stored_size=stored)
        if self._policy == "lru":
            return Candidate(float(access.last_ns), block, parent_key, stored)
        # an engine-keyed record holds a key, not its tokens: its identity says how many
        identity = identity_of(self._t, self._txn, record.identity, self._identities_read)
        tokens = record.n_tokens if identity is None else identity.block_tokens
        value = value_per_byte(record, access, self._now, tokens)
        return Candidate(value, block, parent_key, stored)

    def __iter__(self) -> Iterator[Candidate]:
        while self._heap:
            yield heapq.heappop(self._heap)

    def parent_freed(self, parent_key: bytes) -> None:
        children = self._txn.cursor(db=self._t.children)
        if children.set_key(parent_key):
            return
        raw = self._txn.get(parent_key, db=self._t.blocks)
        if raw is None:
            return  # an identity digest (the root's key), or already gone
        candidate = self._candidate(parent_key, raw)
        if candidate is not None:
            heapq.heappush(self._heap, candidate)


def evict(
    ctx: StoreContext,
    tenancy: Tenancy,
    access: AccessTimes,
    target_bytes: int | None = None,
    tenant: str | None = None,
) -> EvictionReport:
    """Evict leaves, lowest score first, until the stored bytes (the tenant's, with `tenant`) are at
    most `target_bytes`, in one transaction; expired blocks go first and pending read times are
    written first."""
    config = ctx.config
    if config.eviction == "none":
        return EvictionReport(0, 0, 0.0)
    started = time.perf_counter()
    if target_bytes is None:
        target_bytes = int(capacity_bytes(config) * config.low_watermark)
    reclaim_expired(ctx, tenancy)  # what no lookup can reach goes first
    access.sync()  # the reads still counted in memory must be weighed too
    evicted = freed = 0
    for _ in range(PIN_RETRIES):
        round_ = _round(ctx, tenancy, target_bytes, tenant)
        if round_ is not None:
            evicted, freed = round_
            break
    else:
        log.info("eviction rolled back %d times: its victims kept being pinned", PIN_RETRIES)
    if evicted:
        log.info("evicted %d block(s), %d bytes", evicted, freed)
    return EvictionReport(evicted, freed, round(time.perf_counter() - started, 6))


def reclaim_expired(ctx: StoreContext, tenancy: Tenancy) -> int:
    """Remove the blocks past their tenant's time to live, then, with `scrub_retired`, clear the
    store's files of them (prefixd.store.scrub); return how many went."""
    if not tenancy.expires:
        return 0
    now = ctx.clock.time_ns()
    removed = 0
    pages = tree_pages(ctx.env, ctx.tables) if ctx.config.scrub_retired else 0
    with ctx.writing() as txn:
        expired = []
        for block, record in records_after(txn, ctx.tables, None):
            if record is None:
                continue
            tenant = ctx.tenants.tenant_of(txn, record.identity) or ""
            if record.created_ns < tenancy.ttl_cutoff_ns(tenant, now):
                expired.append(block)
        for block in expired:
            removed += remove_subtree(ctx, txn, block, reason="expired")
    if removed:
        log.info("reclaimed %d expired block(s)", removed)
        if ctx.config.scrub_retired:
            clear(ctx, pages)
    return removed


def _round(
    ctx: StoreContext, tenancy: Tenancy, target_bytes: int, tenant: str | None
) -> tuple[int, int] | None:
    """One eviction round: (blocks, bytes) evicted, or None when a victim was pinned meanwhile
    (rolled back). The check and the commit hold the pins' lock, so a later pin finds the block gone
    when it reads again."""
    t = ctx.tables
    freed = 0
    victims: list[bytes] = []
    ctx.syncs.check_writable()  # the read times' fsync just before may have failed
    journal = ctx.journals.open()  # what the round removed is told only if it commits
    txn = ctx.env.begin(write=True)
    try:
        owned = None if tenant is None else ctx.tenants.digests_of(txn, tenant)
        if owned is None:
            stored = counters.read(txn, t.counters, counters.STORED_BYTES)
        else:
            stored = tenancy.stored_bytes(txn, owned)
        if stored > target_bytes:
            queue = VictimQueue(
                txn, t, ctx.config.eviction, ctx.clock.time_ns(), owned, pins=ctx.pins
            )
            for victim in queue:
                if stored <= target_bytes:
                    break
                remove_subtree(ctx, txn, victim.block, reason="evicted")
                victims.append(victim.block)
                stored -= victim.stored_size
                freed += victim.stored_size
                queue.parent_freed(victim.parent_key)
            counters.add(txn, t.counters, counters.EVICTED, len(victims))
        with ctx.pins.lock:
            if ctx.pins.any_held(victims):
                txn.abort()
                return None
            ctx.journals.commit(txn, journal)
    except BaseException:
        txn.abort()
        raise
    finally:
        ctx.journals.close()
    return len(victims), freed
