"""Read times, batched: a lookup notes in memory which blocks it touched, and `sync` writes them.

A lookup must not write (it would serialise every reader behind the one writer), yet eviction and
warm-up weigh blocks by their reads. Runs of blocks are kept whole (a repeated long lookup is one
dict entry). After a failed fsync the times are dropped, not written."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import lmdb

from prefixd.schema.records import AccessRecord
from prefixd.store import counters

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

log = logging.getLogger(__name__)

# Access records written per transaction: a write transaction holds a copy of every page it
# dirties, and the allocator keeps that memory (see prefixd.store.allocator), so one transaction
# over the accesses of a large store would grow the process by most of its access table.
ACCESS_BATCH = 1024


class AccessTimes:
    def __init__(self, ctx: StoreContext) -> None:
        self._ctx = ctx
        self._lock = threading.Lock()
        self._touched: dict[bytes, tuple[int, int]] = {}  # block -> (last read ns, hits)
        self._runs: dict[bytes, tuple[Sequence[bytes], int, int]] = {}  # by last block

    def touch(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            now = self._ctx.clock.time_ns()
            with self._lock:
                _, _, count = self._runs.get(hashes[-1], (None, 0, 0))
                self._runs[hashes[-1]] = (hashes, now, count + 1)

    def pending(self, block: bytes) -> tuple[int, int]:
        with self._lock:
            self._spread()
            return self._touched.get(block, (0, 0))

    def sync(self) -> bool:
        """Write the pending read times and collisions, then fsync; whether the fsync succeeded. A
        failure to write the times (a hint, not data) is only logged."""
        ctx = self._ctx
        with self._lock:
            self._spread()
            touched, self._touched = self._touched, {}
        collisions = ctx.tallies.take_collisions()
        try:
            if ctx.syncs.failure is None:
                self._write(sorted(touched.items()), collisions)
        finally:  # whatever became of the times: the fsync is what the durability bound needs
            synced = ctx.syncs.sync(ctx.env)
        return synced

    def _write(self, pending: Sequence[tuple[bytes, tuple[int, int]]], collisions: int) -> None:
        """Write `pending` in key order (each batch dirties neighbouring pages) and the collision
        count."""
        ctx = self._ctx
        t = ctx.tables
        try:
            for start in range(0, max(1, len(pending)), ACCESS_BATCH):
                with ctx.env.begin(write=True) as txn:
                    for h, (at, hits) in pending[start : start + ACCESS_BATCH]:
                        raw = txn.get(h, db=t.access)
                        if raw is None:  # removed since: an access entry lives as its block does
                            continue
                        old = AccessRecord.read(raw, 0)
                        new = AccessRecord(max(old.last_ns, at), old.hits + hits)
                        txn.put(h, new.encode(), db=t.access)
                    if start == 0:
                        counters.add(txn, t.counters, counters.COLLISIONS, collisions)
        except lmdb.Error as exc:  # a full map or disk
            log.warning("%d access times not recorded: %s", len(pending), exc)

    def _spread(self) -> None:
        touched = self._touched
        for hashes, at, count in self._runs.values():
            for h in hashes:
                last, hits = touched.get(h, (0, 0))
                touched[h] = (max(last, at), hits + count)
        self._runs = {}
