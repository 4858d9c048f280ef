"""Recounting a per-identity counter from the block records, in resumable batches.

Steps that add a per-identity counter (versions 3 and 5) share this: a step that starts clears
the counters it computes, so a rerun never counts twice, then adds up a measure of each record
into its identity's counter, batch by batch.
"""

from __future__ import annotations

from collections.abc import Callable

import lmdb

from prefixd.errors import CorruptRecordError
from prefixd.migrate.steps import ApplyBatch, CountPending, Cursor
from prefixd.schema.records import BlockRecord
from prefixd.store import counters
from prefixd.store.environment import Tables


def recount(
    prefix: bytes, measure: Callable[[BlockRecord], int]
) -> tuple[CountPending, ApplyBatch]:
    """(pending, apply) of a step that computes `prefix + digest` counters from `measure`."""

    def pending(txn: lmdb.Transaction, t: Tables) -> tuple[int, int]:
        """(records to count, records)."""
        blocks = txn.stat(t.blocks)["entries"]
        return blocks, blocks

    def apply(txn: lmdb.Transaction, t: Tables, cursor: Cursor, batch: int) -> tuple[Cursor, int]:
        if cursor is None:
            for stale in counters.read_prefixed(txn, t.counters, prefix):
                txn.delete(prefix + stale, db=t.counters)
        records = txn.cursor(db=t.blocks)
        positioned = records.set_range(cursor) if cursor is not None else records.first()
        sums: dict[bytes, int] = {}
        seen = 0
        while positioned and seen < batch:
            try:
                record = BlockRecord.decode(records.value())
            except CorruptRecordError:
                pass  # verification quarantines it; `prefixd verify` reports it
            else:
                sums[record.identity] = sums.get(record.identity, 0) + measure(record)
            seen += 1
            positioned = records.next()
        next_cursor = bytes(records.key()) if positioned else None
        for digest, total in sums.items():
            counters.add(txn, t.counters, prefix + digest, total)
        return next_cursor, seen

    return pending, apply
