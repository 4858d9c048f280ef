"""Version 3: a running count of each identity's stored bytes.

Per-tenant quotas add up the stored bytes of a tenant's identities on every put; versions 1 and 2
kept only the store-wide total. Version 3 keeps `identity_stored:<digest>` counters in the
`counters` table, maintained in the same transactions as the blocks. This step computes them from
the records; nothing else changes.
"""

from __future__ import annotations

from prefixd.migrate.per_identity import recount
from prefixd.migrate.steps import Migration
from prefixd.store import counters

pending, apply = recount(counters.IDENTITY_STORED, lambda record: record.stored_size)

STEP = Migration(
    version=3,
    description="per-identity stored-byte counters (for per-tenant quotas)",
    pending=pending,
    apply=apply,
)
