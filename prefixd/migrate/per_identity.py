"""Versions 3 and 5: running counts of each identity's stored bytes and blocks, for per-tenant
quotas and reports (`identity_stored:<digest>`, `identity_blocks:<digest>`). A step recomputes
them from the block records in resumable batches, clearing them first so a rerun never counts
twice.
"""

from __future__ import annotations

from collections.abc import Callable

import lmdb

from prefixd.errors import CorruptRecordError
from prefixd.migrate.steps import ApplyBatch, CountPending, Cursor, Migration
from prefixd.schema.records import BlockRecord
from prefixd.store import counters
from prefixd.store.tables import Tables


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


IDENTITY_BYTES = Migration(
    3,
    "per-identity stored-byte counters (for per-tenant quotas)",
    *recount(counters.IDENTITY_STORED, lambda record: record.stored_size),
)
IDENTITY_BLOCKS = Migration(
    5,
    "per-identity stored-block counters (for per-tenant entry counts)",
    *recount(counters.IDENTITY_BLOCKS, lambda record: 1),
)
