"""What the parts of one open store share, handed to each explicitly (no globals)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from prefixd.clock import Clock
from prefixd.schema.meta import StoreMeta
from prefixd.store.codec import PayloadCodec
from prefixd.store.config import StoreConfig
from prefixd.store.direct import DataFile
from prefixd.store.fair import FairPool
from prefixd.store.journal import Journals
from prefixd.store.lookup_memo import VerifiedPrefixes
from prefixd.store.pins import Pins
from prefixd.store.sync_state import SyncState
from prefixd.store.tables import Tables
from prefixd.store.tallies import Tallies
from prefixd.store.tenants import TenantIndex
from prefixd.store.write_behind import WriteBehind


@dataclass(eq=False)
class StoreContext:
    """The handles of one open store: fixed while it is open (a fault test may swap `env`)."""

    config: StoreConfig
    env: lmdb.Environment
    tables: Tables
    meta: StoreMeta  # as read (or written) when the store was opened
    clock: Clock  # every entry age and time to live is read from it
    codec: PayloadCodec
    pool: ThreadPoolExecutor | None  # encode threads (config.verify_threads)
    tenants: TenantIndex  # digest -> tenant, over the identities table
    tallies: Tallies  # this process's counts
    syncs: SyncState  # every fsync goes through it; sticky once one failed (sync_state.py)
    data_file: DataFile  # data.mdb for loads that read it directly (direct.py)
    write_behind: WriteBehind  # puts' pages sent to the disk before the fsync comes
    pins: Pins = field(default_factory=Pins)  # blocks held from eviction (prefixd.store.pins)
    # copy and verify threads shared by every load, a piece of each in turn (prefixd.store.fair)
    copier: FairPool | None = None
    # each thread's write transaction's changes, and the observer told them (journal.py)
    journals: Journals = field(init=False)
    # prefixes verified by a walk or written by a put: lookups and puts both start after them
    memo: VerifiedPrefixes = field(init=False)

    def __post_init__(self) -> None:
        self.memo = VerifiedPrefixes(self.config.verified_cache_bytes)
        self.journals = Journals(self.tables)

    @property
    def path(self) -> Path:
        return self.config.path

    def writing(self) -> AbstractContextManager[lmdb.Transaction]:
        """A write transaction, refused (SyncFailedError) once an fsync failed: the store writes
        nothing more."""
        self.syncs.check_writable()
        return self.journals.writing(self.env)
