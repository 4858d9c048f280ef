"""The data file's space, allocated ahead of LMDB's write map.

With a write map LMDB writes pages straight into its shared mapping of data.mdb, with no copy into
the page cache at commit: a put costs about the bytes it writes. But LMDB makes data.mdb a sparse
file as long as the map, and a write through a mapping into a hole of a full file system is a
SIGBUS, not an error. So the write map is used only where `fallocate` really reserves blocks that
later writes land in without allocating (ext4, XFS, tmpfs; not a copy-on-write file system), and
every write transaction, holding LMDB's writer lock, first makes sure the blocks past the last page
are allocated for as much as it can grow: what it claims (a put's payloads) plus a margin bounding
what any transaction dirties (a copy of every index page at most, and the free list's record).
When they cannot be, the transaction raises DiskFullError before it has written anything."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from pathlib import Path

import lmdb

from prefixd.errors import DiskFullError, StoreWriteError

# statfs(2) magic numbers of the file systems whose fallocate reserves blocks in place
RESERVING_FILE_SYSTEMS = {0xEF53: "ext4", 0x58465342: "xfs", 0x01021994: "tmpfs"}
MIN_MARGIN = 1 << 20  # what a transaction that claims nothing may grow by, at least
MIN_GRAIN = 1 << 20  # the reservation grows by at least this much (or an eighth of the file)
PAGE_CLAIM_PAGES = 16  # pages a claimed value's entries may dirty besides its own (tree paths)


class _StatFs(ctypes.Structure):
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def file_system_of(path: Path) -> str | None:
    """The name of the file system under `path` if its fallocate reserves blocks (None: another,
    or unknown)."""
    buf = _StatFs()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        return None
    return RESERVING_FILE_SYSTEMS.get(buf.f_type & 0xFFFFFFFF)


class Reservation:
    """The allocated blocks of one open data.mdb past its last page; not thread-safe: called only by
    the thread holding LMDB's writer lock."""

    def __init__(self, data_file: Path, file_system: str) -> None:
        self.file_system = file_system
        self._path = data_file.parent
        self.tables: Sequence[lmdb._Database] = ()  # set once the store's tables are open
        self._end = 0
        self._psize = 4096
        self._fd = os.open(data_file, os.O_RDWR | os.O_CLOEXEC)
        self.reserved = 0  # bytes from the start of the file allocated by this process
        self._used = 0  # the file's pages, as of the last commit
        self._claimed = 0  # what the open transaction claimed so far
        self._index_bytes = 0  # branch and leaf pages as of the last commit

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def begun(self, env: lmdb.Environment, txn: lmdb.Transaction, *, strict: bool = True) -> None:
        """A write transaction began: reserve what it may grow by unclaimed. Not `strict`: a
        transaction that only opens tables, on a full file system (reserved as far as it goes)."""
        info = env.info()
        self._psize = psize = env.stat()["psize"]
        self._used = (info["last_pgno"] + 1) * psize
        self._claimed = 0
        self._end = info["map_size"]
        self._index_bytes = _index_pages(env, txn, self.tables) * psize  # a few microseconds
        try:
            self._ensure()
        except DiskFullError:
            if strict:
                raise

    def claim(self, nbytes: int, entries: int) -> None:
        """The open transaction is about to write `nbytes` in `entries` values: reserve them too."""
        self._claimed += nbytes + entries * PAGE_CLAIM_PAGES * self._psize
        self._ensure()

    def _ensure(self) -> None:
        # Every index page copied once, and the free list's record of as many pages as the file has
        # (8 bytes each), twice over; what the transaction adds is claimed.
        margin = MIN_MARGIN + self._index_bytes + self._used // 256
        need = min(self._end, self._used + self._claimed + margin)
        if need <= self.reserved:
            return
        grain = max(MIN_GRAIN, self._used // 8)
        target = min(self._end, -(-need // grain) * grain)
        try:
            os.posix_fallocate(self._fd, self.reserved, target - self.reserved)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"the file system under {self._path} is full: "
                    f"{need - self.reserved} more bytes could not be reserved; the write was "
                    "refused before it began, reads go on, and writes resume once space is freed"
                ) from None
            raise StoreWriteError(f"reserving the store's space failed: {exc}") from None
        self.reserved = target


def _index_pages(
    env: lmdb.Environment, txn: lmdb.Transaction, tables: Sequence[lmdb._Database]
) -> int:
    """Branch and leaf pages of the main tree and every table, read in the open transaction."""
    stat = env.stat()
    total = stat["branch_pages"] + stat["leaf_pages"]
    for db in tables:
        s = txn.stat(db)
        total += s["branch_pages"] + s["leaf_pages"]
    return int(total)
