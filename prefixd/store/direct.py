"""Reading raw payload chunks straight from data.mdb into their destination with preadv, instead
of copying them out of LMDB's map.

Copying from the map costs a page fault for every page this process has not mapped yet (a fresh
daemon on a warm page cache: one minor fault per 4 KiB), and on a cold cache each fault waits for
its own small read. preadv of a whole chunk lets the kernel copy from the page cache (or read
ahead from disk) in large requests with no fault at all. Every value LMDB returns is one
contiguous span of the map, whose offset in the file is the value's address minus the map's
base; the read transaction that returned it stays open until the bytes are verified in their
destination, so LMDB cannot reuse those pages meanwhile.

`read_path` (StoreConfig) picks the path: `mmap` never reads the file; `pread` reads every
payload stored raw from the file; `auto` (the default) reads payloads stored raw of at least
PREAD_MIN_BYTES from the file, smaller ones (where a system call per chunk is most of the cost)
from the map. Compressed payloads are always decoded from the map: zstd reads its input at a
fraction of copy speed, so faulting it in costs little beside decoding it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from prefixd.schema.records import BlockRecord, Compression, PartRecord

PREAD_MIN_BYTES = 64 << 10


class FileSpans(NamedTuple):
    """Where a payload's chunks lie in a file: read them from `fd` at
    `offsets`, straight into the destination, instead of copying them from their views."""

    fd: int
    offsets: tuple[int, ...]


class DataFile:
    """data.mdb opened read-only beside LMDB's map, and where that map lies in this process."""

    def __init__(self, path: Path, read_path: str) -> None:
        self.read_path = read_path
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if read_path != "mmap" else -1
        self._path = path
        # [start, end) of this process's maps of it, read now (LMDB mapped the file when the
        # environment opened) so that no load pays for reading /proc/self/maps (1-2 ms in a
        # daemon); read again only when an address is in none of them
        self._maps: list[tuple[int, int]] = _maps_of(path) if self.fd >= 0 else []

    def spans(
        self, record: BlockRecord | PartRecord, chunks: Sequence[memoryview]
    ) -> FileSpans | None:
        """Where `chunks` (views LMDB returned in an open read transaction) lie in the file, when
        the payload is to be read from it; None to copy it from the map."""
        if self.fd < 0 or record.compression is not Compression.NONE or not chunks:
            return None
        if self.read_path == "auto" and record.stored_size < PREAD_MIN_BYTES:
            return None
        addresses = [_address(chunk) for chunk in chunks]
        base = self._base(addresses[0])
        if base is None:
            return None
        return FileSpans(self.fd, tuple(a - base for a in addresses))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _base(self, address: int) -> int | None:
        """The start of the map of data.mdb holding `address` (LMDB maps the file once, from
        offset 0, when the environment opens: /proc/self/maps is read again only on a miss)."""
        for attempt in range(2):
            for start, end in self._maps:
                if start <= address < end:
                    return start
            if attempt == 0:
                self._maps = _maps_of(self._path)
        return None


def _address(view: memoryview) -> int:
    """The address of a read-only buffer's first byte (reading it faults nothing in)."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _maps_of(path: Path) -> list[tuple[int, int]]:
    """This process's mappings of the file at `path` from file offset 0, by device and inode."""
    info = os.stat(path)
    found = []
    with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or int(fields[2], 16) != 0 or int(fields[4]) != info.st_ino:
                continue
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            if os.makedev(major, minor) != info.st_dev:
                continue
            start, end = (int(part, 16) for part in fields[0].split("-"))
            found.append((start, end))
    return found
