"""Group commit: puts that arrive together share one write transaction and one commit.

A commit costs more than a small put's writes, so whichever put holds the commit lock runs every
body queued by then in one transaction. A refusal or any error aborts the whole group, which then
runs one put at a time, each in its own transaction, so refusals and errors (a full map above all)
behave exactly as they would alone. LMDB's nested transactions could isolate refusals, but each
costs more than a small put (a 2 MiB dirty-page list)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Generic, TypeVar

import lmdb

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

T = TypeVar("T")
R = TypeVar("R")
MAX_GROUP = 64  # bodies per shared transaction: bounds what one commit holds dirty


class _Queued(Generic[T]):
    __slots__ = ("body", "done", "error", "nbytes", "outcome")

    def __init__(self, body: Callable[[lmdb.Transaction], T], nbytes: int) -> None:
        self.body = body
        self.nbytes = nbytes
        self.done = False
        self.outcome: T | None = None
        self.error: BaseException | None = None  # what the body raised, run alone


class CommitQueue(Generic[T]):
    """The puts of one store waiting to commit; thread-safe."""

    def __init__(self, ctx: StoreContext, aborts: Callable[[T], bool]) -> None:
        """`aborts(outcome)`: whether a body's outcome is a refusal (its changes are dropped)."""
        self._ctx = ctx
        self._aborts = aborts
        self._queue: list[_Queued[T]] = []
        self._turn = threading.Condition()  # guards the queue and `_leading`
        self._leading = False  # a put is running a group (or its own transaction) now
        self.groups = 0  # shared transactions committed (more than one body each)

    @property
    def waiting(self) -> int:
        with self._turn:
            return len(self._queue)

    def run(self, body: Callable[[lmdb.Transaction], T], nbytes: int = 0) -> T:
        """Run `body` in a write transaction with whatever other puts are waiting; committed unless
        its outcome aborts. `nbytes`: about what it writes."""
        item = _Queued(body, nbytes)
        with self._turn:
            self._queue.append(item)
            while self._leading and not item.done:
                self._turn.wait()
            if not item.done:
                self._leading = True
            else:
                return self._outcome(item)
        try:
            while not item.done:  # this put leads until its own body has run
                with self._turn:
                    group, self._queue = self._queue[:MAX_GROUP], self._queue[MAX_GROUP:]
                if len(group) == 1 or not self._commit(group):  # one put: its own transaction
                    self._one_by_one(group)
        finally:
            with self._turn:
                self._leading = False
                self._turn.notify_all()
        return self._outcome(item)

    @staticmethod
    def _outcome(item: _Queued[T]) -> T:
        if item.error is not None:
            raise item.error
        assert item.outcome is not None
        return item.outcome

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the turn to commit (a failpoint: puts started meanwhile commit as one group once it
        is let go)."""
        with self._turn:
            while self._leading:
                self._turn.wait()
            self._leading = True
        try:
            yield
        finally:
            with self._turn:
                self._leading = False
                self._turn.notify_all()

    def _commit(self, group: list[_Queued[T]]) -> bool:
        """Run the group in one transaction and commit; False (nothing written) if a body refused or
        anything failed."""

        def run_all(txn: lmdb.Transaction) -> bool:  # whether a body refused
            for item in group:
                item.outcome = item.body(txn)
                if self._aborts(item.outcome):
                    return True
            return False

        try:
            if self._transact(run_all, bool, sum(item.nbytes for item in group)):
                return False
        except BaseException:  # noqa: BLE001 - each put runs again alone, and raises in its thread
            return False
        self.groups += 1
        for item in group:
            item.done = True
        return True

    def _transact(
        self, body: Callable[[lmdb.Transaction], R], aborts: Callable[[R], bool], nbytes: int
    ) -> R:
        """`transact`, its pages sent to the disk as its commit copies them where that pays
        (prefixd.store.write_behind)."""
        with self._ctx.write_behind.committing(nbytes):
            return transact(self._ctx, body, aborts)

    def _one_by_one(self, group: list[_Queued[T]]) -> None:
        """Each body in its own transaction, in order: what the puts would have done alone."""
        for item in group:
            item.outcome = None
            try:
                item.outcome = self._transact(item.body, self._aborts, item.nbytes)
            except BaseException as exc:  # noqa: BLE001 - raised in the put's own thread, as if alone
                item.error = exc
            item.done = True


def transact(
    ctx: StoreContext, body: Callable[[lmdb.Transaction], T], aborts: Callable[[T], bool]
) -> T:
    """Run `body` in one write transaction: committed, or aborted if its outcome `aborts` (or on an
    exception), so a refused put leaves nothing behind and tells the observer nothing."""
    journal = ctx.journals.open()
    txn = ctx.env.begin(write=True, buffers=True)  # chunks are read back from LMDB's own pages
    try:
        outcome = body(txn)
        if aborts(outcome):
            txn.abort()
        else:
            ctx.syncs.check_writable()  # an fsync failed while it was written: not committed
            ctx.journals.commit(txn, journal)
    except BaseException:
        txn.abort()
        raise
    finally:
        ctx.journals.close()
    return outcome
