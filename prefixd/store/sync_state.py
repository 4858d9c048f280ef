"""A failed fsync is never forgotten: the store's sync state, and the marker that outlives it.

Once an fsync of the data file fails, the kernel may have dropped the dirty pages it could not
write (Linux marks them clean), so a later fsync that succeeds proves nothing about them: what the
store acknowledged since its last good sync may be gone from the disk while the page cache still
serves it. Like PostgreSQL with data_sync_retry=off, the store never retries such a sync as if it
could succeed. It enters a sticky state instead: every write is refused with SyncFailedError
(reads go on, each payload verified as always), nothing more is fsynced or written to the access
table, and a marker (SYNC_MARKER, in the store's directory, written and fsynced on its own) records
when the failure happened and when the last good sync began. The next open that may (its process
holds the store, or no process does) checks the blocks written since that last good sync
(prefixd.store.recheck), quarantines what fails, syncs, and removes the marker; an open that may
not (a daemon holds the store) starts in the failed state.

Why not exit, as PostgreSQL panics: for a cache on a GPU node, refusing writes costs the engines
only new entries, while an exit costs every hit until someone acts; a restart in a loop would not
help a dead disk either, and a restart without a reboot checks through the page cache that may
still hold what the disk lost, so it should follow a look at the disk (the daemon reports the
state in `health`, its metrics and its systemd STATUS=), not happen on its own.

A commit under durability `full` fsyncs inside LMDB's commit: if that fails, LMDB rolls the
transaction back (its meta page, the commit point, is not written) and the put is refused as a
StoreWriteError, so nothing acknowledged depends on the lost pages; only the syncs the store makes
itself (the periodic one, `Store.sync`, before a ranking, at close, at open) go through here.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import lmdb

from prefixd.clock import Clock
from prefixd.errors import SyncFailedError

log = logging.getLogger(__name__)

SYNC_MARKER = "sync-failed.json"


def _when(ns: int) -> str:
    """A store-clock time in nanoseconds, as an operator reads it."""
    if ns <= 0:
        return "an unknown time"
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class SyncFailure:
    """A failed fsync of the store: when (store clock, ns), what the OS said, and the start and
    the last transaction of the sync before it that succeeded (0: none is known, so every block
    is unsure)."""

    failed_at_ns: int
    error: str
    last_good_ns: int
    last_good_txn: int

    def describe(self) -> str:
        last = (
            f"the last good sync began at {_when(self.last_good_ns)} (transaction "
            f"{self.last_good_txn})"
            if self.last_good_ns > 0
            else "no good sync is known"
        )
        return f"an fsync of the store failed at {_when(self.failed_at_ns)} ({self.error}); {last}"

    def refusal(self, path: Path) -> str:
        """What a refused write tells its caller: what happened, what still works, what to do."""
        return (
            f"the store at {path} refuses writes: {self.describe()}, so what it acknowledged "
            "since may not be on disk; reads go on. Check the disk (dmesg), then restart "
            "prefixd: the next start checks the blocks written since the last good sync"
        )

    def encode(self) -> bytes:
        return json.dumps({**asdict(self), "pid": os.getpid()}).encode()

    @classmethod
    def decode(cls, data: bytes) -> SyncFailure:
        """ValueError, KeyError or TypeError if `data` is no marker this code wrote."""
        fields = json.loads(data)
        return cls(
            failed_at_ns=int(fields["failed_at_ns"]),
            error=str(fields["error"]),
            last_good_ns=int(fields["last_good_ns"]),
            last_good_txn=int(fields["last_good_txn"]),
        )


def read_marker(path: Path) -> SyncFailure | None:
    """The failure the marker in the store directory `path` records; None when there is none.
    A marker that cannot be read counts as a failure with no good sync known."""
    try:
        data = (path / SYNC_MARKER).read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return SyncFailure(0, f"the marker {SYNC_MARKER} cannot be read: {exc}", 0, 0)
    try:
        return SyncFailure.decode(data)
    except (ValueError, KeyError, TypeError):
        return SyncFailure(0, f"the marker {SYNC_MARKER} is damaged", 0, 0)


class SyncState:
    """Whether every fsync of one open store has succeeded, and when the last one did; one sync
    at a time. `inherited` is the failure a marker left by an earlier run records, if any."""

    def __init__(self, path: Path, clock: Clock) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._failure: SyncFailure | None = None
        self.inherited = read_marker(path)
        # Until this run's first good sync, what an earlier run's marker says was last good
        self.last_good_ns = self.inherited.last_good_ns if self.inherited else 0
        self.last_good_txn = self.inherited.last_good_txn if self.inherited else 0

    @property
    def failure(self) -> SyncFailure | None:
        """The failed sync that put the store in the sticky state (None: every sync succeeded)."""
        return self._failure

    def sync(self, env: lmdb.Environment) -> bool:
        """fsync `env`; whether it succeeded. After a failure, now or earlier, nothing is
        fsynced again and the answer is False: the failure is recorded, never raised here."""
        with self._lock:
            if self._failure is not None:
                return False
            txn = env.info()["last_txnid"]
            started = self._clock.time_ns()
            try:
                env.sync(True)
            except lmdb.Error as exc:
                self._fail(str(exc))
                return False
            self.last_good_ns, self.last_good_txn = started, txn
            return True

    def check_writable(self) -> None:
        """SyncFailedError if a sync has failed: the store acknowledges no write from then on."""
        failure = self._failure
        if failure is not None:
            raise SyncFailedError(failure.refusal(self.path))

    def adopt(self, failure: SyncFailure) -> None:
        """Start in the failed state an earlier run's marker records (this open may not check
        the unsure blocks: another process holds the store)."""
        with self._lock:
            if self._failure is None:
                self._failure = failure

    def fail(self, error: str) -> None:
        """Enter the failed state for a reason found outside `sync` (a check at open that could
        not finish), unless already in it."""
        with self._lock:
            if self._failure is None:
                self._fail(error)

    def clear_marker(self) -> None:
        """Remove the marker once the blocks it made unsure are checked and a sync succeeded."""
        with contextlib.suppress(FileNotFoundError):
            (self.path / SYNC_MARKER).unlink()
        _fsync_directory(self.path)
        self.inherited = None

    def _fail(self, error: str) -> None:
        """Record the failure (call under the lock) and the marker, and say so loudly."""
        failure = self._failure = SyncFailure(
            failed_at_ns=self._clock.time_ns(),
            error=error,
            last_good_ns=self.last_good_ns,
            last_good_txn=self.last_good_txn,
        )
        log.error(
            "%s: %s. The store refuses writes from now on (reads go on); check the disk, then "
            "restart prefixd: the next start checks the blocks written since the last good sync",
            self.path,
            failure.describe(),
        )
        try:
            _write_durably(self.path / SYNC_MARKER, failure.encode())
        except OSError as exc:
            log.error(
                "could not record the failed sync in %s (%s): the next start will not know to "
                "check the blocks written since the last good sync; run `prefixd verify`",
                self.path / SYNC_MARKER,
                exc,
            )


def _write_durably(target: Path, data: bytes) -> None:
    """Write `data` to `target` whole or not at all, fsynced with its directory entry."""
    temporary = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o640)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, target)
    _fsync_directory(target.parent)


def _fsync_directory(path: Path) -> None:
    """fsync a directory, so that a file created, renamed or removed in it stays so."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        log.warning("fsync of the directory %s failed: %s", path, exc)
    finally:
        os.close(fd)


__all__ = ["SYNC_MARKER", "SyncFailure", "SyncState", "read_marker"]
