"""Version 2: access records gain a hit count, which eviction by value per byte needs
(V = p C_saved / (M T)): (last access ns u64, hits u32, reserved u32). Existing blocks keep their
last access and start at 0 hits; nothing else changes.
"""

from __future__ import annotations

import struct

import lmdb

from prefixd.migrate.steps import Cursor, Migration
from prefixd.schema.records import AccessRecord
from prefixd.store.tables import Tables

_V1 = struct.Struct("<Q")


def pending(txn: lmdb.Transaction, t: Tables) -> tuple[int, int]:
    """(version-1 access records, access records)."""
    old = total = 0
    for value in txn.cursor(db=t.access).iternext(keys=False, values=True):
        total += 1
        old += len(value) == _V1.size
    return old, total


def apply(txn: lmdb.Transaction, t: Tables, cursor: Cursor, batch: int) -> tuple[Cursor, int]:
    """Rewrite up to `batch` access records from `cursor` on; return where to go on, and how many
    changed. Records already in the new layout are left alone, so a batch may safely run twice."""
    records = txn.cursor(db=t.access)
    positioned = records.set_range(cursor) if cursor is not None else records.first()
    changed = seen = 0
    while positioned and seen < batch:
        key, value = bytes(records.key()), bytes(records.value())
        if len(value) == _V1.size:
            (last_ns,) = _V1.unpack(value)
            records.put(key, AccessRecord(last_ns, 0).encode())
            changed += 1
        seen += 1
        positioned = records.next()
    return (bytes(records.key()) if positioned else None), changed


STEP = Migration(
    version=2,
    description="access records gain a hit count (u64 last access -> u64 last access, u32 hits)",
    pending=pending,
    apply=apply,
)
