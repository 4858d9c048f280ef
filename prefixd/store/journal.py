"""What each write transaction stored and removed, told to the store's observer once it commits.

KV events for routers must name exactly the blocks the store holds, so a change counts only when its
transaction commits: every write path opens its transaction through `Journals.writing` (or `open`,
`commit` and `close`), and the put path and `remove_subtree` note changes in this thread's journal.
Without an observer nothing is noted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
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
        self,
        txn: lmdb.Transaction,
        h: bytes,
        record: BlockRecord | None,
        reason: str,
        digest: bytes | None,
    ) -> None:
        """`digest`: the identity the block is charged to (its parent's, for a record too damaged
        to say its own)."""
        identity = identity_of(self._tables, txn, digest, self._identities) if digest else None
        if record is None:  # too damaged to say what it was: its hash, and its parent's identity
            self.changes.append(BlockChange(reason, h, b"", b"", identity))
            return
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
        # held from a commit until its changes are told: LMDB lets the next writer in at the
        # commit, and its changes told first (a removal before the store it undoes) would leave a
        # router's view holding a block the store no longer has
        self._telling = threading.Lock()

    def current(self) -> Journal | None:
        if self.observer is None:
            return None
        journal: Journal | None = getattr(self._open, "journal", None)
        return journal

    def open(self) -> Journal | None:
        journal = Journal(self._tables) if self.observer is not None else None
        self._open.journal = journal
        return journal

    def close(self) -> None:
        """Forget the thread's journal (committed and told, or aborted)."""
        self._open.journal = None

    def commit(self, txn: lmdb.Transaction, journal: Journal | None) -> None:
        """Commit `txn`, then tell the observer its changes, in the order the commits were made
        (the observer's failure is only logged: the transaction is committed either way)."""
        observer = self.observer
        if journal is None or not journal.changes or observer is None:
            txn.commit()
            return
        with self._telling:
            txn.commit()
            try:
                observer.committed(journal.changes)
            except Exception:
                log.exception(
                    "the block observer failed; %d change(s) not told", len(journal.changes)
                )

    @contextmanager
    def writing(self, env: lmdb.Environment) -> Iterator[lmdb.Transaction]:
        """A write transaction whose changes reach the observer once, and only if, it commits."""
        journal = self.open()
        try:
            with env.begin(write=True) as txn:
                yield txn
                self.commit(txn, journal)
        finally:
            self.close()


def inventory(
    env: lmdb.Environment,
    tables: Tables,
    after: bytes,
    limit: int,
    min_created: Callable[[lmdb.Transaction, bytes], int],
) -> tuple[list[BlockChange], bytes]:
    """The stored blocks among the `limit` after `after` (b"": from the first) as STORED changes,
    each call in a read transaction of its own, so walking millions of blocks never holds one
    snapshot open; and the last block read (b"": none left). A block created before
    `min_created(txn, its identity digest)` is past its tenant's time to live: no lookup serves
    it, so it is left out."""
    found: list[BlockChange] = []
    identities: dict[bytes, Identity | None] = {}
    last, read = b"", 0
    with env.begin() as txn:
        for h, record in records_after(txn, tables, after or None):
            last, read = h, read + 1
            # a damaged or expired record is no block a lookup can reach
            if record is not None and record.created_ns >= min_created(txn, record.identity):
                identity = identity_of(tables, txn, record.identity, identities)
                parent_tokens = keyed_parent(tables, txn, record, identity)
                found.append(
                    BlockChange(STORED, h, record.parent, record.tokens, identity, parent_tokens)
                )
            if read >= limit:
                break
    return found, (last if read >= limit else b"")
