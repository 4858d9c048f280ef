"""What a migration step is, and the ordered list of them.

Like alembic's revisions: step N turns a version N-1 store into a version N store. A step works in
batches so a large store never needs one huge transaction; each batch commits together with the
step's resume cursor in the meta record, and the last batch commits the new version stamp. A
killed migration therefore resumes where it stopped, and a store is always at exactly one version.
The steps themselves are listed in prefixd.migrate.runner.
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
