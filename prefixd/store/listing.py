"""A tenant's stored blocks, page by page (LMCache's `list_l2_keys`, an operator's inventory).

Pages follow hash order, so the cursor is the last hash examined and nothing repeats. A page reads
at most SCAN_LIMIT records, so a tenant with few of a large store's blocks gets short pages, never
one that reads the whole store."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from prefixd.schema.identity import Identity
from prefixd.schema.stored import ListedBlock
from prefixd.store.tables import identity_of, records_after

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

SCAN_LIMIT = 65536


def list_blocks(
    ctx: StoreContext, tenant: str, stored_as: str, after: bytes | None, limit: int
) -> tuple[list[ListedBlock], bytes | None]:
    """Up to `limit` of the tenant's blocks (stored under `stored_as`) after `after`, and the next
    cursor (None: complete)."""
    found: list[ListedBlock] = []
    with ctx.env.begin(buffers=True) as txn:
        owned = ctx.tenants.digests_of(txn, stored_as)
        if not owned:
            return [], None
        identities: dict[bytes, Identity] = {}
        for digest in owned:
            identity = identity_of(ctx.tables, txn, digest, {})  # None: check reports it
            if identity is not None:
                identities[digest] = dataclasses.replace(identity, tenant=tenant)
        last, scanned = after, 0
        for key, record in records_after(txn, ctx.tables, after):
            if len(found) >= limit or scanned >= SCAN_LIMIT:
                return found, last
            scanned += 1  # noqa: SIM113 - counts the scan, which returns early
            if record is not None and record.identity in identities:
                found.append(
                    ListedBlock(
                        identities[record.identity], bytes(record.tokens), record.payload_size
                    )
                )
            last = key
    return found, None
