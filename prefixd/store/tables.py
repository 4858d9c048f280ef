"""The store's tables (LMDB named databases) and how their keys are made:
meta        b"meta" -> StoreMeta
blocks      block hash -> BlockRecord
chunks      block hash (or part key) + u32 BE index -> stored payload chunk
children    parent hash (identity digest for first blocks) -> child hash (dupsort)
access      block hash -> AccessRecord
quarantine  block hash -> msgpack {at_ns, reason}
counters    name -> u64 totals, kept in the same transactions as the data
identities  identity digest -> Identity.encode()
parts       block hash + u8 group -> PartRecord (since schema version 4)"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeVar

import lmdb

from prefixd.errors import CorruptRecordError, IdentityError
from prefixd.schema.chain import ROOT_PARENT
from prefixd.schema.identity import Identity
from prefixd.schema.records import BlockRecord, PartRecord, chunk_key

_V = TypeVar("_V", bound=bytes | memoryview)
META_KEY = b"meta"
TABLE_NAMES = (
    "meta",
    "blocks",
    "chunks",
    "children",
    "access",
    "quarantine",
    "counters",
    "identities",
    "parts",
)


@dataclass(frozen=True)
class Tables:
    meta: lmdb._Database
    blocks: lmdb._Database
    chunks: lmdb._Database
    children: lmdb._Database
    access: lmdb._Database
    quarantine: lmdb._Database
    counters: lmdb._Database
    identities: lmdb._Database
    parts: lmdb._Database | None  # None only in a read-only view of a store older than version 4


def parent_key(identity_digest: bytes, parent: bytes) -> bytes:
    """The children-index key a block hangs under: its parent's hash, or for a first block its
    identity's digest (so an identity's blocks can be enumerated)."""
    return identity_digest if parent == ROOT_PARENT else parent


def children_key(record: BlockRecord) -> bytes:
    return parent_key(record.identity, record.parent)


def records_after(
    txn: lmdb.Transaction, tables: Tables, after: bytes | None
) -> Iterator[tuple[bytes, BlockRecord | None]]:
    """The blocks table in hash order after `after` (None: from the start), each record None when
    too damaged to decode."""
    cursor = txn.cursor(db=tables.blocks)
    more = cursor.set_range(after) if after else cursor.first()
    if more and after is not None and bytes(cursor.key()) == after:
        more = cursor.next()
    while more:
        yield bytes(cursor.key()), decoded(cursor.value())
        more = cursor.next()


def decoded(raw: bytes | memoryview) -> BlockRecord | None:
    try:
        return BlockRecord.decode(raw)
    except CorruptRecordError:
        return None


def decoded_part(raw: bytes | memoryview | None) -> PartRecord | None:
    """The part record `raw` encodes; None when absent or too damaged to decode."""
    try:
        return None if raw is None else PartRecord.decode(raw)
    except CorruptRecordError:
        return None


def payload_chunks(
    txn: lmdb.Transaction[_V], tables: Tables, key: bytes, record: BlockRecord | PartRecord
) -> list[_V] | None:
    """The chunks of the payload stored under `key`; None if one is missing or they do not add
    up to the record's stored size."""
    chunks = [txn.get(chunk_key(key, n), db=tables.chunks) for n in range(record.n_chunks)]
    present = [c for c in chunks if c is not None]
    if len(present) < len(chunks) or sum(len(c) for c in present) != record.stored_size:
        return None
    return present


def prefixed(cursor: lmdb.Cursor[_V], prefix: bytes) -> Iterator[tuple[bytes, _V]]:
    """The cursor's entries whose keys start with `prefix`, in key order."""
    if cursor.set_range(prefix):
        for stored_key, value in cursor:
            key = bytes(stored_key)
            if not key.startswith(prefix):
                return
            yield key, value


def stored_record(txn: lmdb.Transaction, tables: Tables, h: bytes) -> BlockRecord | None:
    raw = txn.get(h, db=tables.blocks)
    return None if raw is None else decoded(raw)


def readable_identities(txn: lmdb.Transaction, tables: Tables) -> Iterator[tuple[bytes, Identity]]:
    """Every identity row that decodes, with its digest (check reports the others)."""
    for digest, encoded in txn.cursor(db=tables.identities):
        try:
            yield bytes(digest), Identity.decode(bytes(encoded), bytes(digest))
        except IdentityError:
            continue


def identity_of(
    tables: Tables, txn: lmdb.Transaction, digest: bytes, memo: dict[bytes, Identity | None]
) -> Identity | None:
    """The identity `digest` names (None: no readable row), remembered in `memo` for the rest of the
    transaction."""
    if digest not in memo:
        encoded = txn.get(digest, db=tables.identities)
        try:
            memo[digest] = None if encoded is None else Identity.decode(bytes(encoded), digest)
        except IdentityError:
            memo[digest] = None
    return memo[digest]
