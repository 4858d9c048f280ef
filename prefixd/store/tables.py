"""The store's tables and how their keys are made.

Tables (LMDB named databases):
  meta        b"meta" -> StoreMeta
  blocks      block hash -> BlockRecord
  chunks      block hash + u32 BE index -> stored payload chunk
  children    parent hash (or identity digest for first blocks) -> child hash (dupsort)
  access      block hash -> last access, u64 ns
  quarantine  block hash -> msgpack {at_ns, reason} of blocks dropped for failing verification
  counters    name -> u64 running totals kept in the same transactions as the data
  identities  identity digest -> Identity.encode()
  parts       block hash + u8 group -> PartRecord of a hybrid identity's state-group payload
              (its chunks live in `chunks` under the part key), since schema version 4
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import lmdb

from prefixd.errors import CorruptRecordError, IdentityError
from prefixd.schema.chain import ROOT_PARENT
from prefixd.schema.identity import Identity
from prefixd.schema.records import BlockRecord

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
    """Handles of the store's named databases."""

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
    """`parent_key` of the block `record` describes."""
    return parent_key(record.identity, record.parent)


def records_after(
    txn: lmdb.Transaction, tables: Tables, after: bytes | None
) -> Iterator[tuple[bytes, BlockRecord | None]]:
    """The blocks table in hash order from the first hash past `after` (from the start for
    None), each with its record (None when it is too damaged to decode: verification
    quarantines it, listings leave it out)."""
    cursor = txn.cursor(db=tables.blocks)
    more = cursor.set_range(after) if after else cursor.first()
    if more and after is not None and bytes(cursor.key()) == after:
        more = cursor.next()
    while more:
        yield bytes(cursor.key()), decoded(cursor.value())
        more = cursor.next()


def decoded(raw: bytes | memoryview) -> BlockRecord | None:
    """The block record `raw` encodes; None when it is too damaged to decode (verification
    quarantines it)."""
    try:
        return BlockRecord.decode(raw)
    except CorruptRecordError:
        return None


def stored_record(txn: lmdb.Transaction, tables: Tables, h: bytes) -> BlockRecord | None:
    """Block `h`'s record as `txn` sees it; None when it is not stored or too damaged."""
    raw = txn.get(h, db=tables.blocks)
    return None if raw is None else decoded(raw)


def readable_identities(txn: lmdb.Transaction, tables: Tables) -> Iterator[tuple[bytes, Identity]]:
    """Every identity row with its digest, leaving out those that do not decode (check reports
    them)."""
    for digest, encoded in txn.cursor(db=tables.identities):
        try:
            yield bytes(digest), Identity.decode(bytes(encoded))
        except IdentityError:
            continue


def identity_of(
    tables: Tables, txn: lmdb.Transaction, digest: bytes, memo: dict[bytes, Identity | None]
) -> Identity | None:
    """The identity `digest` names as `txn` sees it (None: no readable row), remembered in
    `memo` for the rest of the transaction."""
    if digest not in memo:
        encoded = txn.get(digest, db=tables.identities)
        try:
            memo[digest] = None if encoded is None else Identity.decode(bytes(encoded))
        except IdentityError:
            memo[digest] = None
    return memo[digest]
