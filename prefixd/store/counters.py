"""Running totals kept in the `counters` table, updated inside the data's own transactions."""

from __future__ import annotations

import struct

import lmdb

from prefixd.store.tables import prefixed

_U64 = struct.Struct("<q")

BLOCKS = b"blocks"
PARTS = b"parts"  # state-group payloads of hybrid identities (v4)
PAYLOAD_BYTES = b"payload_bytes"
STORED_BYTES = b"stored_bytes"
QUARANTINED = b"quarantined"
COLLISIONS = b"collisions"
SETTLES = b"settles"  # small commits that let LMDB reuse freed pages on a full map
REMOVALS = b"removals"  # bumped by every transaction that removes blocks: the removal epoch
EVICTED = b"evicted"
NAMES = (
    BLOCKS,
    PARTS,
    PAYLOAD_BYTES,
    STORED_BYTES,
    QUARANTINED,
    COLLISIONS,
    SETTLES,
    REMOVALS,
    EVICTED,
)


IDENTITY_STORED = b"identity_stored:"  # + identity digest: stored bytes of that identity (v3)


def identity_stored(digest: bytes) -> bytes:
    return IDENTITY_STORED + digest


IDENTITY_BLOCKS = b"identity_blocks:"  # + identity digest: that identity's stored blocks (v5)


def identity_blocks(digest: bytes) -> bytes:
    return IDENTITY_BLOCKS + digest


def read_prefixed(txn: lmdb.Transaction, db: lmdb._Database, prefix: bytes) -> dict[bytes, int]:
    found = prefixed(txn.cursor(db=db), prefix)
    return {key[len(prefix) :]: _U64.unpack(bytes(raw))[0] for key, raw in found}


def read(txn: lmdb.Transaction, db: lmdb._Database, name: bytes) -> int:
    raw = txn.get(name, db=db)
    return _U64.unpack(bytes(raw))[0] if raw is not None else 0


def add(txn: lmdb.Transaction, db: lmdb._Database, name: bytes, delta: int) -> None:
    """Add `delta` in the caller's write transaction, never below zero; a counter at zero is
    removed, so vanished identities' counters do not pile up."""
    if delta:
        value = max(0, read(txn, db, name) + delta)
        if value:
            txn.put(name, _U64.pack(value), db=db)
        else:
            txn.delete(name, db=db)


def read_all(txn: lmdb.Transaction, db: lmdb._Database) -> dict[bytes, int]:
    return {name: read(txn, db, name) for name in NAMES}
