"""What each write transaction stored and removed, told to the store's observer once it commits.

KV events for routers must name exactly the blocks the store holds, so a change counts only when its
transaction commits: every write path opens its transaction through `Journals.writing` (or `open`
and `close`), and the put path and `remove_subtree` note changes in this thread's journal. Without
an observer nothing is noted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import lmdb

from prefixd.schema.chain import ROOT_PARENT
from prefixd.schema.identity import Identity
from prefixd.schema.records import BlockRecord
from prefixd.store.tables import Tables, identity_of, records_after, stored_record

log = logging.getLogger(__name__)

STORED = "stored"


@dataclass(frozen=True, slots=True)
class BlockChange:
    reason: str  # STORED, or why it went: evicted, quarantined, expired, purged, retired, deleted
    block: bytes  # its chain hash
    parent: bytes  # its parent's chain hash (ROOT_PARENT for a prompt's first block)
    tokens: bytes  # its packed '<u4' token ids (an engine-keyed block's key); b"" when unreadable
    identity: Identity | None  # None when its record or identity row could not be read
    parent_tokens: bytes = b""  # an engine-keyed block's: its parent's key (b"" for the first)

    @property
    def stored(self) -> bool:
        return self.reason == STORED


class BlockObserver(Protocol):
    def committed(self, changes: Sequence[BlockChange]) -> None: ...


class Journal:
    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self.changes: list[BlockChange] = []
        self._identities: dict[bytes, Identity | None] = {}

    def stored(
        self, txn: lmdb.Transaction, h: bytes, record: BlockRecord, identity: Identity
    ) -> None:
        parent_tokens = keyed_parent(self._tables, txn, record, identity)
        change = BlockChange(STORED, h, record.parent, record.tokens, identity, parent_tokens)
        self.changes.append(change)

    def removed(
        self, txn: lmdb.Transaction, h: bytes, record: BlockRecord | None, reason: str
    ) -> None:
        if record is None:  # too damaged to say what it was: its hash alone
            self.changes.append(BlockChange(reason, h, b"", b"", None))
            return
        identity = identity_of(self._tables, txn, record.identity, self._identities)
        self.changes.append(BlockChange(reason, h, record.parent, record.tokens, identity))


def keyed_parent(
    tables: Tables, txn: lmdb.Transaction, record: BlockRecord, identity: Identity | None
) -> bytes:
    """The key of an engine-keyed block's parent (what the engine names it by); b"" otherwise."""
    if identity is None or identity.key_bytes is None or record.parent == ROOT_PARENT:
        return b""
    parent = stored_record(txn, tables, record.parent)
    return b"" if parent is None else parent.tokens


class Journals:
    """The journal of each thread's open write transaction (LMDB allows one per thread), and the
    observer."""

    def __init__(self, tables: Tables) -> None:
        self._tables = tables
        self._open = threading.local()
        self.observer: BlockObserver | None = None

    def current(self) -> Journal | None:
        if self.observer is None:
            return None
        journal: Journal | None = getattr(self._open, "journal", None)
        return journal

    def open(self) -> Journal | None:
        journal = Journal(self._tables) if self.observer is not None else None
        self._open.journal = journal
        return journal

    def close(self, journal: Journal | None, *, committed: bool) -> None:
        """Forget the thread's journal; after a commit, tell the observer (whose failure is only
        logged: the transaction is committed either way)."""
        self._open.journal = None
        observer = self.observer
        if not committed or journal is None or not journal.changes or observer is None:
            return
        try:
            observer.committed(journal.changes)
        except Exception:
            log.exception("the block observer failed; %d change(s) not told", len(journal.changes))

    @contextmanager
    def writing(self, env: lmdb.Environment) -> Iterator[lmdb.Transaction]:
        """A write transaction whose changes reach the observer once, and only if, it commits."""
        journal = self.open()
        try:
            with env.begin(write=True) as txn:
                yield txn
        except BaseException:
            self.close(journal, committed=False)
            raise
        self.close(journal, committed=True)


def inventory(env: lmdb.Environment, tables: Tables, after: bytes, limit: int) -> list[BlockChange]:
    """Up to `limit` stored blocks after `after` (b"": from the first) as STORED changes, each call
    in a read transaction of its own, so walking millions of blocks never holds one snapshot open.
    """
    found: list[BlockChange] = []
    identities: dict[bytes, Identity | None] = {}
    with env.begin() as txn:
        for h, record in records_after(txn, tables, after or None):
            if record is None:
                continue  # a damaged record is no block a lookup can reach
            identity = identity_of(tables, txn, record.identity, identities)
            parent_tokens = keyed_parent(tables, txn, record, identity)
            found.append(
                BlockChange(STORED, h, record.parent, record.tokens, identity, parent_tokens)
            )
            if len(found) >= limit:
                break
    return found
