"""What a migration step is. Like alembic's revisions, step N turns a version N-1 store into
version N, in batches that each commit with the step's resume cursor; the last commits the new
version, so a killed migration resumes and a store is always at exactly one version.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import lmdb

from prefixd.store.tables import Tables

Cursor = bytes | None
# (txn, tables, resume cursor or None to start, batch size) -> (next cursor or None when done, changed)
ApplyBatch = Callable[[lmdb.Transaction, Tables, Cursor, int], tuple[Cursor, int]]
CountPending = Callable[[lmdb.Transaction, Tables], tuple[int, int]]


@dataclass(frozen=True)
class Migration:
    """One step of the on-disk schema: it produces `version` from `version - 1`."""

    version: int
    description: str
    pending: CountPending  # (items the step would change, items it looks at): for dry runs
    apply: ApplyBatch
