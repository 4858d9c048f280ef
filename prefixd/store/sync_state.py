"""A failed fsync is never forgotten: the store's sync state, and the marker that outlives it.

Once an fsync fails, the kernel may have dropped the dirty pages it could not write (Linux marks
them clean), so a later fsync that succeeds proves nothing. Like PostgreSQL with
data_sync_retry=off, the store never retries: it refuses every write with SyncFailedError (reads
go on, verified as always), fsyncs and writes nothing more, and records the failure in a marker
(SYNC_MARKER). The next open that may (it holds the store, or nobody does) rechecks the blocks
written since the last good sync (prefixd.store.recheck) and removes the marker.

It does not exit: for a cache, refusing writes costs only new entries, and a restart loop would
not help a dead disk. A commit under durability `full` fsyncs inside LMDB's commit, which rolls
back on failure (StoreWriteError); only the store's own syncs come through here."""

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
from prefixd.store.environment import give_to_directory_owner

log = logging.getLogger(__name__)

SYNC_MARKER = "sync-failed.json"


def _when(ns: int) -> str:
    if ns <= 0:
        return "an unknown time"
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat(timespec="milliseconds")


@dataclass(frozen=True)
class SyncFailure:
    """A failed fsync: when, what the OS said, and the start and last transaction of the last good
    sync before it (0: none known, every block is unsure)."""

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
    """The failure the marker in `path` records, or None; an unreadable marker counts as a failure
    with no good sync known."""
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
    """Whether every fsync of one open store has succeeded, and when the last did; `inherited`: the
    failure an earlier run's marker records."""

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
        return self._failure

    def sync(self, env: lmdb.Environment) -> bool:
        """fsync `env`; whether it succeeded. After a failure, now or earlier, nothing is fsynced
        again: the failure is recorded, never raised here."""
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
        failure = self._failure
        if failure is not None:
            raise SyncFailedError(failure.refusal(self.path))

    def adopt(self, failure: SyncFailure) -> None:
        """Start failed, as the marker records (another process holds the store, so this open may
        not recheck)."""
        with self._lock:
            if self._failure is None:
                self._failure = failure

    def fail(self, error: str) -> None:
        with self._lock:
            if self._failure is None:
                self._fail(error)

    def clear_marker(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.path / SYNC_MARKER).unlink()
        _fsync_directory(self.path)
        self.inherited = None

    def _fail(self, error: str) -> None:
        """Record the failure (under the lock) and its marker, and say so loudly."""
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
    give_to_directory_owner(temporary)  # root's failed migration: the daemon must read it
    os.replace(temporary, target)
    _fsync_directory(target.parent)


def _fsync_directory(path: Path) -> None:
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
