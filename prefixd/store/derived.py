"""What is derived from the sound block records (children index, access records, stray chunks and
parts, counters), rebuilt by a repair and by the recheck after a failed fsync."""

from __future__ import annotations

from collections import Counter

import lmdb

from prefixd.errors import CorruptRecordError
from prefixd.schema.chain import HASH_BYTES
from prefixd.schema.records import AccessRecord, BlockRecord, PartRecord
from prefixd.store import counters
from prefixd.store.tables import Tables, children_key, decoded_part, records_after


def rebuild_derived(txn: lmdb.Transaction, t: Tables, now_ns: int) -> int:
    """Rebuild what follows from the block records (the caller quarantined the damaged ones);
    return how many entries changed."""
    records = {h: r for h, r in records_after(txn, t, None) if r is not None}
    parts, dropped = _drop_stray_parts(txn, t, records)
    return (
        dropped
        + _rebuild_children(txn, t, records)
        + _rebuild_access(txn, t, records, now_ns)
        + _drop_stray_chunks(txn, t, records, parts)
        + _rebuild_counters(txn, t, records, parts)
    )


def _rebuild_children(txn: lmdb.Transaction, t: Tables, records: dict[bytes, BlockRecord]) -> int:
    expected = {(children_key(r), h) for h, r in records.items()}
    present = {(bytes(k), bytes(v)) for k, v in txn.cursor(db=t.children)}
    for parent, child in present - expected:
        txn.delete(parent, child, db=t.children)
    for parent, child in expected - present:
        txn.put(parent, child, db=t.children)
    return len(present - expected) + len(expected - present)


def _rebuild_access(
    txn: lmdb.Transaction, t: Tables, records: dict[bytes, BlockRecord], now_ns: int
) -> int:
    changed = 0
    stray = [
        bytes(k) for k in txn.cursor(db=t.access).iternext(values=False) if bytes(k) not in records
    ]
    for key in stray:
        txn.delete(key, db=t.access)
    for h, record in records.items():
        raw = txn.get(h, db=t.access)
        try:
            if raw is not None:
                AccessRecord.decode(raw)
                continue
        except CorruptRecordError:
            pass
        txn.put(h, AccessRecord(min(record.created_ns, now_ns), 0).encode(), db=t.access)
        changed += 1
    return changed + len(stray)


def _drop_stray_parts(
    txn: lmdb.Transaction, t: Tables, records: dict[bytes, BlockRecord]
) -> tuple[dict[bytes, PartRecord], int]:
    kept: dict[bytes, PartRecord] = {}
    stray = []
    if t.parts is not None:
        for stored_key, raw in txn.cursor(db=t.parts):
            key = bytes(stored_key)
            part = decoded_part(raw)
            if part is not None and key[:HASH_BYTES] in records and len(key) == HASH_BYTES + 1:
                kept[key] = part
            else:
                stray.append(key)
        for key in stray:
            txn.delete(key, db=t.parts)
    return kept, len(stray)


def _drop_stray_chunks(
    txn: lmdb.Transaction,
    t: Tables,
    records: dict[bytes, BlockRecord],
    parts: dict[bytes, PartRecord],
) -> int:
    stray = []
    for key in txn.cursor(db=t.chunks).iternext(values=False):
        key = bytes(key)
        owner, index = key[:-4], int.from_bytes(key[-4:], "big")
        holder = records.get(owner) if len(owner) == HASH_BYTES else parts.get(owner)
        if holder is None or index >= holder.n_chunks:
            stray.append(key)
    for key in stray:
        txn.delete(key, db=t.chunks)
    return len(stray)


def _rebuild_counters(
    txn: lmdb.Transaction,
    t: Tables,
    records: dict[bytes, BlockRecord],
    parts: dict[bytes, PartRecord],
) -> int:
    wanted: Counter[bytes] = Counter()
    for record in records.values():
        wanted[counters.BLOCKS] += 1
        wanted[counters.PAYLOAD_BYTES] += record.payload_size
        wanted[counters.STORED_BYTES] += record.stored_size
        wanted[counters.identity_stored(record.identity)] += record.stored_size
        wanted[counters.identity_blocks(record.identity)] += 1
    for key, part in parts.items():
        identity = records[key[:HASH_BYTES]].identity
        wanted[counters.PARTS] += 1
        wanted[counters.PAYLOAD_BYTES] += part.payload_size
        wanted[counters.STORED_BYTES] += part.stored_size
        wanted[counters.identity_stored(identity)] += part.stored_size
    names = {counters.BLOCKS, counters.PARTS, counters.PAYLOAD_BYTES, counters.STORED_BYTES}
    for prefix in (counters.IDENTITY_STORED, counters.IDENTITY_BLOCKS):
        names |= {prefix + d for d in counters.read_prefixed(txn, t.counters, prefix)}
    names |= set(wanted)
    wrong = 0
    for name in names:
        have = counters.read(txn, t.counters, name)
        if have != wanted[name]:
            counters.add(txn, t.counters, name, wanted[name] - have)
            wrong += 1
    return wrong
