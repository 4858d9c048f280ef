"""Reading raw payload chunks straight from data.mdb into their destination with preadv.

Copying from the map costs a page fault per page not mapped yet (on a cold cache, a small read
each); preadv lets the kernel copy or read ahead in large requests. A value's offset in the file is
its address minus the map's base; its read transaction stays open until the bytes are verified, so
LMDB cannot reuse the pages meanwhile. `read_path` `auto` reads only raw payloads of at least
PREAD_MIN_BYTES this way; compressed ones are decoded from the map (zstd is far slower than the
faults)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from prefixd.schema.records import BlockRecord, Compression, PartRecord

PREAD_MIN_BYTES = 64 << 10


class FileSpans(NamedTuple):
    fd: int
    offsets: tuple[int, ...]


class DataFile:
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
        """Where `chunks` lie in the file, when the payload is to be read from it; None to copy it
        from the map."""
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
        """The start of the map of data.mdb holding `address`; /proc/self/maps is read again only on
        a miss."""
        for attempt in range(2):
            for start, end in self._maps:
                if start <= address < end:
                    return start
            if attempt == 0:
                self._maps = _maps_of(self._path)
        return None


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _maps_of(path: Path) -> list[tuple[int, int]]:
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
