"""Version 5: a running count of each identity's stored blocks.

The daemon reports stored entries per tenant; version 4 kept only the store-wide block count.
Version 5 keeps `identity_blocks:<digest>` counters, maintained in the same transactions as the
blocks. This step computes them from the records; nothing else changes.
"""

from __future__ import annotations

from prefixd.migrate.per_identity import recount
from prefixd.migrate.steps import Migration
from prefixd.store import counters

pending, apply = recount(counters.IDENTITY_BLOCKS, lambda record: 1)

STEP = Migration(
    version=5,
    description="per-identity stored-block counters (for per-tenant entry counts)",
    pending=pending,
    apply=apply,
)
