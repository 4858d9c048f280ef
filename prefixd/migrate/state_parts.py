"""Version 4: a `parts` table for the state-group payloads of hybrid identities.

Hybrid models keep several kinds of prefix state (prefixd.schema.state); each payload is a part
record hung on a block. Older stores have no hybrid entries, so the step has nothing to convert:
the table is created, empty, when the migration opens the store, and the step stamps the version.
"""

from __future__ import annotations

import lmdb

from prefixd.migrate.steps import Cursor, Migration
from prefixd.store.tables import Tables


def pending(txn: lmdb.Transaction, t: Tables) -> tuple[int, int]:
    """(items to change, items looked at): nothing is converted."""
    return 0, 0


def apply(txn: lmdb.Transaction, t: Tables, cursor: Cursor, batch: int) -> tuple[Cursor, int]:
    if t.parts is None:
        raise RuntimeError("the parts table must be opened writable before this step")
    return None, 0


STEP = Migration(
    version=4,
    description="parts table for hybrid state groups (created empty)",
    pending=pending,
    apply=apply,
)
