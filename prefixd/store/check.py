"""A full consistency check that reports every problem, not just the first."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import lmdb

from prefixd.errors import CorruptRecordError, StoreOpenError
from prefixd.schema.chain import HASH_BYTES, ROOT_PARENT
from prefixd.schema.meta import StoreMeta
from prefixd.schema.records import AccessRecord, BlockRecord, PartRecord, chunk_key
from prefixd.store import counters
from prefixd.store.codec import checksum, chunks_present
from prefixd.store.results import Problem
from prefixd.store.tables import META_KEY, Tables, children_key, readable_identities

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext


def check(
    ctx: StoreContext,
    *,
    verify_payloads: bool = True,
    progress: Callable[[int], None] | None = None,
) -> list[Problem]:
    with ctx.env.begin(buffers=True) as txn:
        return check_store(txn, ctx.tables, verify_payloads=verify_payloads, progress=progress)


def check_store(
    txn: lmdb.Transaction[memoryview],
    t: Tables,
    *,
    verify_payloads: bool,
    progress: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Every inconsistency, in one read transaction; `progress` is told how many block records were
    checked."""
    problems: list[Problem] = []
    raw_meta = txn.get(META_KEY, db=t.meta)
    if raw_meta is None:
        problems.append(Problem("meta", "meta record is missing"))
    else:
        try:
            StoreMeta.decode(bytes(raw_meta))
        except StoreOpenError as exc:
            problems.append(Problem("meta", str(exc)))

    records: dict[bytes, BlockRecord] = {}
    totals: Counter[bytes] = Counter()  # the inventory counters, as the tables hold them
    for n, (key, raw) in enumerate(txn.cursor(db=t.blocks), 1):
        if progress is not None and n % 1024 == 0:
            progress(1024)
        h = bytes(key)
        try:
            record = BlockRecord.decode(raw)
        except CorruptRecordError as exc:
            problems.append(Problem("record", str(exc), h))
            continue
        if len(h) != HASH_BYTES:
            problems.append(Problem("record", f"key is {len(h)} bytes, not {HASH_BYTES}", h))
        records[h] = record
        totals[counters.BLOCKS] += 1
        totals[counters.PAYLOAD_BYTES] += record.payload_size
        totals[counters.STORED_BYTES] += record.stored_size
        chunks = [txn.get(chunk_key(h, n), db=t.chunks) for n in range(record.n_chunks)]
        if not chunks_present(chunks):
            problems.append(Problem("payload", "a payload chunk is missing", h))
            continue
        if sum(len(c) for c in chunks) != record.stored_size:
            problems.append(Problem("payload", "stored size differs from the record", h))
        elif verify_payloads and checksum(chunks) != record.checksum:
            problems.append(Problem("payload", "payload fails its checksum", h))

    if progress is not None:
        progress(txn.stat(t.blocks)["entries"] % 1024)
    parts = _check_parts(txn, t, records, totals, problems, verify_payloads=verify_payloads)

    rows = {bytes(k) for k in txn.cursor(db=t.identities).iternext(keys=True, values=False)}
    identities = {digest for digest, _ in readable_identities(txn, t)}
    for h, record in records.items():
        if record.parent != ROOT_PARENT and record.parent not in records:
            problems.append(Problem("orphan", "block's parent is not stored", h))
        if record.identity not in identities:  # no tenant, quota, TTL or purge would find it
            damaged = record.identity in rows
            what = "row is damaged" if damaged else "is not registered"
            problems.append(Problem("identity", f"block's identity {what}", h))

    indexed: set[tuple[bytes, bytes]] = set()
    for key, value in txn.cursor(db=t.children):
        parent, child = bytes(key), bytes(value)
        indexed.add((parent, child))
        child_record = records.get(child)
        if child_record is None:
            problems.append(Problem("children", "index names a block that is not stored", child))
        elif parent != children_key(child_record):
            problems.append(
                Problem("children", "index files a block under the wrong parent", child)
            )
    for h, record in records.items():
        if (children_key(record), h) not in indexed:
            problems.append(Problem("children", "block is missing from the children index", h))

    for stored_key in txn.cursor(db=t.chunks).iternext(keys=True, values=False):
        ckey = bytes(stored_key)
        owner, index = ckey[:HASH_BYTES], int.from_bytes(ckey[-4:], "big")
        owner_record = records.get(owner)
        if owner_record is None:
            problems.append(Problem("chunk", "chunk belongs to no stored block", owner))
        elif len(ckey) == HASH_BYTES + 5:
            part = parts.get(ckey[: HASH_BYTES + 1])
            if part is None or index >= part.n_chunks:
                problems.append(Problem("chunk", "chunk of a part that does not hold it", owner))
        elif index >= owner_record.n_chunks or len(ckey) != HASH_BYTES + 4:
            problems.append(Problem("chunk", "chunk beyond its block's chunk count", owner))
    for key, value in txn.cursor(db=t.access):
        block = bytes(key)
        if block not in records:
            problems.append(Problem("access", "access record of a block that is not stored", block))
            continue
        try:
            AccessRecord.decode(value)
        except CorruptRecordError as exc:
            problems.append(Problem("access", str(exc), block))
    for h in records:
        if txn.get(h, db=t.access) is None:
            problems.append(Problem("access", "block has no access record", h))

    per_identity: Counter[bytes] = Counter()
    for record in records.values():
        per_identity[record.identity] += record.stored_size
    for pk, part in parts.items():
        per_identity[records[pk[:HASH_BYTES]].identity] += part.stored_size
    kept_per_identity = counters.read_prefixed(txn, t.counters, counters.IDENTITY_STORED)
    if kept_per_identity != {d: n for d, n in per_identity.items() if n}:
        problems.append(Problem("counters", "per-identity stored bytes differ from the tables"))
    blocks_per_identity = Counter(record.identity for record in records.values())
    if counters.read_prefixed(txn, t.counters, counters.IDENTITY_BLOCKS) != blocks_per_identity:
        problems.append(Problem("counters", "per-identity block counts differ from the tables"))

    kept = counters.read_all(txn, t.counters)
    for name in (counters.BLOCKS, counters.PARTS, counters.PAYLOAD_BYTES, counters.STORED_BYTES):
        if kept[name] != totals[name]:
            detail = f"{name.decode()} counter is {kept[name]}, the tables hold {totals[name]}"
            problems.append(Problem("counters", detail))
    return problems


def _check_parts(
    txn: lmdb.Transaction[memoryview],
    t: Tables,
    records: dict[bytes, BlockRecord],
    totals: Counter[bytes],
    problems: list[Problem],
    *,
    verify_payloads: bool,
) -> dict[bytes, PartRecord]:
    """Check every part; return the sound ones hung on a stored block, by key."""
    sound: dict[bytes, PartRecord] = {}
    if t.parts is None:
        return sound
    for stored_key, raw in txn.cursor(db=t.parts):
        key = bytes(stored_key)
        block = key[:HASH_BYTES]
        try:
            part = PartRecord.decode(raw)
        except CorruptRecordError as exc:
            problems.append(Problem("part", str(exc), block))
            continue
        if len(key) != HASH_BYTES + 1 or part.group != key[-1]:
            problems.append(Problem("part", "part key does not match its record", block))
            continue
        if block not in records:
            problems.append(Problem("part", "part hangs on a block that is not stored", block))
            continue
        totals[counters.PARTS] += 1
        totals[counters.PAYLOAD_BYTES] += part.payload_size
        totals[counters.STORED_BYTES] += part.stored_size
        sound[key] = part
        chunks = [txn.get(chunk_key(key, n), db=t.chunks) for n in range(part.n_chunks)]
        if not chunks_present(chunks):
            problems.append(Problem("part", "a part's payload chunk is missing", block))
        elif sum(len(c) for c in chunks) != part.stored_size:
            problems.append(Problem("part", "a part's stored size differs from its record", block))
        elif verify_payloads and checksum(chunks) != part.checksum:
            problems.append(Problem("part", "a part's payload fails its checksum", block))
    return sound
