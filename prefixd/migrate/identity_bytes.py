"""Version 3: a running count of each identity's stored bytes.

Per-tenant quotas add up the stored bytes of a tenant's identities on every put; versions 1 and 2
kept only the store-wide total. Version 3 keeps `identity_stored:<digest>` counters in the
`counters` table, maintained in the same transactions as the blocks. This step computes them from
the records; nothing else changes.
"""

from __future__ import annotations

import lmdb

from prefixd.migrate.steps import Cursor, Migration
from prefixd.schema.records import BlockRecord, CorruptRecordError
from prefixd.store import counters
from prefixd.store.environment import Tables


def pending(txn: lmdb.Transaction, t: Tables) -> tuple[int, int]:
    """(records to count, records)."""
    blocks = txn.stat(t.blocks)["entries"]
    return blocks, blocks


def apply(txn: lmdb.Transaction, t: Tables, cursor: Cursor, batch: int) -> tuple[Cursor, int]:
    """Count up to `batch` records from `cursor` on into their identities' counters. A step that
    starts (cursor None) first clears any counters, so a rerun never counts twice."""
    if cursor is None:
        stale = [
            bytes(key)
            for key in txn.cursor(db=t.counters).iternext(keys=True, values=False)
            if bytes(key).startswith(counters.IDENTITY_STORED)
        ]
        for key in stale:
            txn.delete(key, db=t.counters)
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
            sums[record.identity] = sums.get(record.identity, 0) + record.stored_size
        seen += 1
        positioned = records.next()
    next_cursor = bytes(records.key()) if positioned else None
    for digest, stored in sums.items():
        counters.add(txn, t.counters, counters.identity_stored(digest), stored)
    return next_cursor, seen


STEP = Migration(
    version=3,
    description="per-identity stored-byte counters (for per-tenant quotas)",
    pending=pending,
    apply=apply,
)
