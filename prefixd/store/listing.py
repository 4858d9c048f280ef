"""A tenant's stored blocks, page by page: what an engine that asks "which keys do you hold?"
(LMCache's `list_l2_keys`) or an operator's inventory reads.

Pages follow the `blocks` table's order (block hashes), so a cursor is the last hash a page
examined and a listing never repeats a block; blocks put or removed while it runs may or may not
appear. A page reads at most `SCAN_LIMIT` records, so a tenant that holds few of a large store's
blocks gets short (even empty) pages with a cursor, never one page that reads the whole store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING

import lmdb

from prefixd.errors import CorruptRecordError, IdentityError
from prefixd.schema.identity import Identity
from prefixd.schema.records import BlockRecord
from prefixd.schema.stored import ListedBlock

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext
    from prefixd.store.tenancy import Tenancy

SCAN_LIMIT = 65536


def records_after(
    txn: lmdb.Transaction, ctx: StoreContext, after: bytes | None
) -> Iterator[tuple[bytes, BlockRecord | None]]:
    """The blocks table in hash order from the first hash past `after` (from the start for
    None), each with its record (None when it is too damaged to decode: verification
    quarantines it, listings leave it out)."""
    cursor = txn.cursor(db=ctx.tables.blocks)
    more = cursor.set_range(after) if after else cursor.first()
    if more and after is not None and bytes(cursor.key()) == after:
        more = cursor.next()
    while more:
        try:
            record: BlockRecord | None = BlockRecord.decode(cursor.value())
        except CorruptRecordError:
            record = None
        yield bytes(cursor.key()), record
        more = cursor.next()


def list_blocks(
    ctx: StoreContext, tenancy: Tenancy, tenant: str, after: bytes | None, limit: int
) -> tuple[list[ListedBlock], bytes | None]:
    """Up to `limit` of the tenant's blocks whose hashes follow `after`, and the cursor of the
    next page (None: the listing is complete)."""
    stored_as = tenancy.stored_as(tenant)
    found: list[ListedBlock] = []
    with ctx.env.begin(buffers=True) as txn:
        owned = ctx.tenants.digests_of(txn, stored_as)
        if not owned:
            return [], None
        identities: dict[bytes, Identity] = {}
        for digest in owned:
            raw = txn.get(digest, db=ctx.tables.identities)
            try:
                identity = Identity.decode(bytes(raw)) if raw is not None else None
            except IdentityError:
                identity = None  # check reports it
            if identity is not None:
                identities[digest] = dataclasses.replace(identity, tenant=tenant)
        last, scanned = after, 0
        for key, record in records_after(txn, ctx, after):
            if len(found) >= limit or scanned >= SCAN_LIMIT:
                return found, last
            scanned += 1
            if record is not None and record.identity in identities:
                found.append(
                    ListedBlock(
                        identities[record.identity], bytes(record.tokens), record.payload_size
                    )
                )
            last = key
    return found, None


__all__ = ["SCAN_LIMIT", "list_blocks"]
