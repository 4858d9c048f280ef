"""Starting the disk writes of committed pages while puts go on, so the next fsync has little left.

Under `periodic` durability a commit only copies its pages into the page cache; the kernel writes
them out when the fsync comes (or when its dirty limits are reached). A node putting a stream of
large blocks then computes and copies first, and waits on the disk after: the two add up. Once
enough has been committed since, a thread asks the kernel to start writing the file's dirty pages
(`sync_file_range(SYNC_FILE_RANGE_WRITE)`, which waits for nothing written), so the disk works
while the next puts are encoded and copied. It neither syncs nor orders anything: durability is
still the periodic fsync's, and a writeback error it meets is reported by that fsync, as the kernel
keeps it for every descriptor of the file.

Under `full` durability each commit fsyncs before the put is acknowledged, so there is nothing to
start early between commits; but a large commit first copies its pages into the page cache, then
waits for the fsync to write them all. While such a commit runs (`committing`), the thread asks
every COMMIT_KICK_S, so the disk writes the pages as they land and the fsync finds few left."""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)

SYNC_FILE_RANGE_WRITE = 2
KICK_BYTES = 32 << 20  # committed bytes between two kicks: large sequential writes, few calls
COMMIT_KICK_S = 0.002  # between two kicks while a large commit copies its pages (a few MiB)


class WriteBehind:
    """Kicks the writeback of data.mdb: under `periodic` every KICK_BYTES committed, under `full`
    all along a large transaction; thread-safe."""

    def __init__(self, data_file: Path, *, full: bool, kick_bytes: int | None = None) -> None:
        """`full`: the store's durability is `full` (each commit fsyncs)."""
        self._full = full
        self._fd = os.open(data_file, os.O_RDONLY | os.O_CLOEXEC)
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._kick_bytes = KICK_BYTES if kick_bytes is None else kick_bytes
        self._pending = 0
        self._lock = threading.Lock()
        self._due = threading.Event()
        self._committing = threading.Event()
        self._stopped = threading.Event()
        self._closed = False
        self._refused = False  # a kick failed once (warned)
        self.kicks = 0
        self._thread = threading.Thread(target=self._run, name="prefixd-write-behind", daemon=True)
        self._thread.start()

    def committed(self, nbytes: int) -> None:
        """A commit copied about `nbytes` into the page cache (under `full` it fsynced them)."""
        if self._full:
            return
        with self._lock:
            self._pending += nbytes
            if self._pending < self._kick_bytes:
                return
            self._pending = 0
        self._due.set()

    @contextmanager
    def committing(self, nbytes: int) -> Iterator[None]:
        """A transaction writing about `nbytes` runs in the block: under `full`, from KICK_BYTES on,
        kick all along it (before its commit nothing is dirty, and a kick costs little)."""
        if not self._full or nbytes < self._kick_bytes:
            yield
            return
        self._committing.set()
        self._due.set()
        try:
            yield
        finally:
            self._committing.clear()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            if self._closed:
                return
            self._kick()
            while self._committing.is_set():  # the pages of the next few ms
                if self._stopped.wait(COMMIT_KICK_S):
                    return
                self._kick()

    def _kick(self) -> None:
        done = self._libc.sync_file_range(
            self._fd, ctypes.c_int64(0), ctypes.c_int64(0), SYNC_FILE_RANGE_WRITE
        )
        if done != 0:  # a write error: the next fsync reports it, and refuses writes from then on
            reason = os.strerror(ctypes.get_errno())
            if not self._refused:
                log.warning(
                    "write-behind: sync_file_range on the store's file failed (%s); puts go on "
                    "and wait for the fsync instead (a sandbox must allow @sync)",
                    reason,
                )
            else:
                log.debug("write-behind: sync_file_range: %s", reason)
            self._refused = True
        self.kicks += 1

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopped.set()
        self._due.set()
        self._thread.join()
        os.close(self._fd)
