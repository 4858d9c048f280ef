"""Shared memory between a client and the daemon: a sealed memfd passed over the socket.

The client sizes the memfd, seals it against shrinking and growing (so the daemon can never fault
on a page taken away), touches every page and sends it with SCM_RIGHTS; the daemon maps it and
copies verified payloads straight in. Replies name offsets and lengths, so bulk data never
crosses the socket.
"""

from __future__ import annotations

import array
import fcntl
import logging
import mmap
import os
import socket
from collections.abc import Sequence
from typing import Self

import numpy as np

from prefixd.errors import ProtocolError
from prefixd.wire.errors import ErrorCode

log = logging.getLogger(__name__)

_REQUIRED_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


class SharedRegion:
    """The client's side: a preallocated, touched, sealed memory region."""

    def __init__(self, size: int, *, name: str = "prefixd-region") -> None:
        if size <= 0:
            raise ValueError(f"region size must be positive, got {size}")
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            self._mmap = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.size = size
        self.view = memoryview(self._mmap)
        np.frombuffer(self.view, dtype=np.uint8).fill(0)  # first touch now, not on the hot path
        self.pinned = False

    @property
    def mapping(self) -> mmap.mmap:
        """The mapping itself (the client's leases make ctypes buffers over spans of it)."""
        return self._mmap

    def pin(self) -> bool:
        """Register the region as page-locked with CUDA (with torch and a GPU), so a copy to the
        GPU is one DMA; whether it is pinned."""
        if not self.pinned:
            self.pinned = pin_with_cuda(self.view)
        return self.pinned

    def close(self) -> None:
        if self.fd < 0:
            return
        if self.pinned:
            unpin_with_cuda(self.view)
            self.pinned = False
        os.close(self.fd)
        self.fd = -1
        _unmap(self.view, self._mmap)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def pin_with_cuda(view: memoryview) -> bool:
    """Register `view`'s pages as page-locked with CUDA (with torch and a GPU), so a copy to or
    from the GPU is one DMA; whether they are."""
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    status = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
        address, len(view), 0
    )
    return int(status) == 0


def unpin_with_cuda(view: memoryview) -> None:
    import torch

    address = np.frombuffer(view, dtype=np.uint8).ctypes.data
    torch.cuda.cudart().cudaHostUnregister(address)  # type: ignore[no-untyped-call]


class MappedRegion:
    """The daemon's side: a client's region mapped from the descriptor it sent."""

    def __init__(self, fd: int, size: int, max_bytes: int) -> None:
        """Map `fd` (closing it); refuses a region that is too large, smaller than claimed, or
        not sealed against shrinking and growing. `populate` then maps its pages in."""
        try:
            if not 0 < size <= max_bytes:
                raise ProtocolError(
                    ErrorCode.BAD_REGION, f"region size must be in [1, {max_bytes}], got {size}"
                )
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError:
                raise ProtocolError(ErrorCode.BAD_REGION, "descriptor is not a memfd") from None
            if seals & _REQUIRED_SEALS != _REQUIRED_SEALS:
                raise ProtocolError(
                    ErrorCode.BAD_REGION, "memfd must be sealed with F_SEAL_SHRINK and F_SEAL_GROW"
                )
            if os.fstat(fd).st_size != size:
                raise ProtocolError(ErrorCode.BAD_REGION, "region size differs from the memfd's")
            # No MAP_POPULATE: on a sparse memfd it would allocate the whole region, charged to
            # the daemon. Only the ranges the client allocated are mapped in (`populate`).
            try:
                self._mmap = mmap.mmap(fd, size)
            except OSError as exc:  # e.g. a memfd sealed against writing (EPERM)
                raise ProtocolError(
                    ErrorCode.BAD_REGION, f"memfd cannot be mapped read-write: {exc.strerror}"
                ) from None
            self.allocated = allocated_ranges(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.view = memoryview(self._mmap)

    def populate(self) -> int:
        """Map in the pages the client allocated, so the first load takes no page faults (never
        allocating a hole); the bytes populated. Tenths of a second per GiB: off the loop."""
        done = 0
        for start, end in self.allocated:
            try:
                self._mmap.madvise(MADV_POPULATE_WRITE, start, end - start)
            except OSError:  # a kernel before 5.14: touch a byte of each page instead
                pages = np.frombuffer(self._mmap, dtype=np.uint8, count=end - start, offset=start)
                int(pages[:: mmap.PAGESIZE].max())  # a read fault maps a shmem page writable
            done += end - start
        return done

    def span(self, offset: int, length: int) -> memoryview:
        """The bytes [offset, offset + length) of the region, or BAD_REGION if out of bounds."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ProtocolError(
                ErrorCode.BAD_REGION,
                f"range [{offset}, {offset + length}) is outside the region of {self.size} bytes",
            )
        return self.view[offset : offset + length]

    def close(self) -> None:
        _unmap(self.view, self._mmap)


MADV_POPULATE_WRITE = 23  # Linux >= 5.14; Python's mmap module does not name it
# A region allocated in more pieces than this is not populated (a first load faults its pages in
# as before): one madvise per piece, and a hostile client could send millions of them.
MAX_POPULATED_RANGES = 4096


def allocated_ranges(fd: int, size: int) -> tuple[tuple[int, int], ...]:
    """The page-aligned [start, end) ranges of memfd `fd` that hold pages (SEEK_DATA and
    SEEK_HOLE); none when fragmented past MAX_POPULATED_RANGES or it cannot be asked."""
    if os.fstat(fd).st_blocks * 512 >= size:
        return ((0, size),)
    ranges: list[tuple[int, int]] = []
    at = 0
    try:
        while at < size and len(ranges) <= MAX_POPULATED_RANGES:
            start = os.lseek(fd, at, os.SEEK_DATA)
            start -= start % mmap.PAGESIZE
            end = min(os.lseek(fd, start, os.SEEK_HOLE), size)
            ranges.append((start, end))
            at = end
    except OSError:  # ENXIO: no data past `at`
        pass
    return tuple(ranges) if len(ranges) <= MAX_POPULATED_RANGES else ()


def _unmap(view: memoryview, mapping: mmap.mmap) -> None:
    """Unmap now, or while views of it live (a caller's, a copy's), with the last of them."""
    try:
        view.release()
        mapping.close()
    except BufferError:
        pass


def send_with_fds(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    """Send `data` with `fds` attached (blocking socket); the fds travel with the first byte."""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])


def fds_from_ancillary(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """Descriptors carried in received ancillary data."""
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % array.array("i").itemsize
            fds.extend(array.array("i", data[:usable]))
    return fds
