"""Version 4: a `parts` table for hybrid identities' state-group payloads. Older stores hold no
hybrid entries, so the table is created empty and the step only stamps the version.
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
