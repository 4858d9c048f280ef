"""What this process counted since it opened the store, and the store's stats.

Lookups, hits and loads are rates for the daemon's metrics; hash collisions wait here until the
next sync writes them to the counters table (a lookup does not write); removals are counted per
tenant and reason. All of it lives in memory under one lock: none of it is inventory (the
counters table, kept in the data's own transactions, is).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixd.store import counters
from prefixd.store.results import StoreStats

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext


@dataclass(frozen=True)
class Activity:
    """Lookups and loads since the store was opened."""

    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0


class Tallies:
    """This process's counts; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lookups = self._hit_blocks = self._loaded_blocks = self._loaded_bytes = 0
        self._collisions = 0
        self._removals: Counter[tuple[str, str]] = Counter()

    def count(
        self,
        *,
        lookups: int = 0,
        hit_blocks: int = 0,
        loaded_blocks: int = 0,
        loaded_bytes: int = 0,
    ) -> None:
        """Add to the activity counts (one call per operation, so one lock round)."""
        with self._lock:
            self._lookups += lookups
            self._hit_blocks += hit_blocks
            self._loaded_blocks += loaded_blocks
            self._loaded_bytes += loaded_bytes

    def activity(self) -> Activity:
        with self._lock:
            return Activity(
                self._lookups, self._hit_blocks, self._loaded_blocks, self._loaded_bytes
            )

    def collided(self) -> None:
        """A stored block's hash turned out to be owned by other tokens (counted, then synced)."""
        with self._lock:
            self._collisions += 1

    def pending_collisions(self) -> int:
        with self._lock:
            return self._collisions

    def take_collisions(self) -> int:
        """The collisions not yet written to the counters table, now handed to the caller."""
        with self._lock:
            taken, self._collisions = self._collisions, 0
            return taken

    def removed(self, tenant: str, reason: str, blocks: int) -> None:
        """Count removed blocks (after the write commits the count may run ahead of a
        transaction that aborted: it is a rate, not an inventory)."""
        with self._lock:
            self._removals[tenant, reason] += blocks

    def removals(self) -> dict[str, dict[str, int]]:
        """Blocks removed, per tenant and reason."""
        with self._lock:
            tally = dict(self._removals)
        out: dict[str, dict[str, int]] = {}
        for (tenant, reason), blocks in tally.items():
            out.setdefault(tenant, {})[reason] = blocks
        return out


def store_stats(ctx: StoreContext) -> StoreStats:
    """The persisted totals, this process's activity and the codec's speeds."""
    t = ctx.tables
    with ctx.env.begin() as txn:
        totals = counters.read_all(txn, t.counters)
        n_identities = txn.stat(t.identities)["entries"]
    info = ctx.env.info()
    used = (info["last_pgno"] + 1) * ctx.env.stat()["psize"]
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
        map_used_bytes=used,
        compression_ratio=payload / stored if stored else 1.0,
        lookups=activity.lookups,
        hit_blocks=activity.hit_blocks,
        loaded_blocks=activity.loaded_blocks,
        loaded_bytes=activity.loaded_bytes,
        verify_failures=c.verify_failures,
        compress_gbps=c.compress_in_bytes / c.compress_s / 1e9 if c.compress_s else 0.0,
        decompress_gbps=c.decompress_out_bytes / c.decompress_s / 1e9 if c.decompress_s else 0.0,
        compressed_payloads_stored_raw=c.stored_raw_after_trial,
        destinations_changed=c.destinations_changed,
        file_read_bytes=c.file_read_bytes,
        deadline_cutoffs=c.deadline_cutoffs,
    )
