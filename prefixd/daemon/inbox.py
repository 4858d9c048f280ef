"""A connection's incoming bytes cut into frames, without I/O: the daemon's side of
prefixd.wire.frames.FrameReader, with descriptors and oversized frames.

Reading ahead into one buffer brings a request's header and body (and the frames pipelined
behind it) in with one recvmsg, where reading the header and then the body takes two, and a
third to learn that nothing more is there.

Descriptors (SCM_RIGHTS) belong to the frame they came with. A client sends a frame and its
descriptors with one sendmsg, and Linux ends a recvmsg right after the bytes the descriptors
were sent with: so the descriptors one read returns belong to the frame holding that read's
last byte. Each batch is kept with the stream offset of that byte and handed to that frame;
a batch no frame took (its frame was skipped) is closed, and so is everything pending when
more than MAX_FDS_PER_FRAME wait at once or the kernel truncated them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import NamedTuple

from prefixd.wire.frames import HEADER, MAX_FDS_PER_FRAME

READ_AHEAD_BYTES = 64 << 10


class Frame(NamedTuple):
    """One whole frame: its body (a view valid until the next `space()`) and descriptors."""

    body: memoryview
    fds: list[int]


class Oversized(NamedTuple):
    """A frame whose header claims more than the limit (nothing of it consumed yet)."""

    length: int


def close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Inbox:
    """The bytes read from one connection and not yet handed out as frames."""

    def __init__(self, size: int = READ_AHEAD_BYTES) -> None:
        self._buffer = bytearray(size)
        self._view = memoryview(self._buffer)
        self._start = 0  # the first byte not yet handed out
        self._end = 0  # the end of the bytes read
        self._offset = 0  # the stream offset of _start (of the large body's frame, when one)
        self._large: memoryview | None = None  # a body too long for the buffer, being read
        self._large_have = 0
        self._skip = 0  # bytes of a refused frame still to drop
        self._received = 0  # stream bytes received in all
        self._fds: list[tuple[int, list[int]]] = []  # (offset of the read's last byte, fds)

    @property
    def empty(self) -> bool:
        """Nothing buffered: the stream stands at a frame boundary."""
        return self._start == self._end and self._large is None and not self._skip

    @property
    def skipping(self) -> bool:
        """Dropping a refused frame's bytes as they come."""
        return bool(self._skip)

    @property
    def fds_pending(self) -> bool:
        return bool(self._fds)

    def space(self) -> memoryview:
        """Where the next read goes (never empty)."""
        if self._large is not None:
            return self._large[self._large_have :]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and self._end == len(self._buffer):  # move the partial frame up front
            pending = self._end - self._start
            self._buffer[:pending] = self._view[self._start : self._end]
            self._start, self._end = 0, pending
        return self._view[self._end :]

    def filled(self, n: int, fds: Sequence[int] = (), truncated: bool = False) -> None:
        """`n` bytes (n > 0) were read into the last `space()`, with these descriptors."""
        self._received += n
        if self._large is not None:
            self._large_have += n
        else:
            self._end += n
            if self._skip:
                self._drop()
        if fds:
            self._fds.append((self._received - 1, list(fds)))
        if truncated or sum(len(batch) for _, batch in self._fds) > MAX_FDS_PER_FRAME:
            self.close_pending()  # never hoard a flood of descriptors

    def next_frame(self, max_body: int) -> Frame | Oversized | None:
        """The next whole frame, an oversized one's length, or None until more bytes come."""
        large = self._large
        if large is not None:
            if self._large_have < len(large):
                return None
            self._large = None
            begin = self._offset
            self._offset += HEADER.size + len(large)
            return Frame(large, self._take_fds(begin, self._offset))
        if self._skip:
            return None
        have = self._end - self._start
        if have < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer, self._start)
        if length > max_body:
            return Oversized(length)
        begin = self._start + HEADER.size
        if begin + length <= self._end:
            self._start = begin + length
            first = self._offset
            self._offset += HEADER.size + length
            return Frame(self._view[begin : begin + length], self._take_fds(first, self._offset))
        if HEADER.size + length <= len(self._buffer):
            return None  # it fits the buffer: wait for the rest
        body = memoryview(bytearray(length))
        got = self._end - begin
        body[:got] = self._view[begin : self._end]
        self._start = self._end = 0
        self._large, self._large_have = body, got
        return None

    def skip(self, length: int) -> None:
        """Drop the oversized frame `next_frame` reported (its header and `length` bytes)."""
        self._start += HEADER.size
        self._offset += HEADER.size
        self._skip = length
        self._drop()

    def close_pending(self) -> None:
        for _, batch in self._fds:
            close_fds(batch)
        self._fds.clear()

    def _drop(self) -> None:
        dropped = min(self._skip, self._end - self._start)
        self._start += dropped
        self._offset += dropped
        self._skip -= dropped
        if not self._skip:
            self._take_fds(self._offset, self._offset)  # what came with the dropped frame

    def _take_fds(self, begin: int, end: int) -> list[int]:
        """The descriptors of the frame at stream offsets [begin, end); earlier ones (of a frame
        that was dropped) are closed."""
        if not self._fds:
            return []
        taken: list[int] = []
        while self._fds and self._fds[0][0] < end:
            at, batch = self._fds.pop(0)
            if at >= begin:
                taken.extend(batch)
            else:
                close_fds(batch)
        return taken


__all__ = ["READ_AHEAD_BYTES", "Frame", "Inbox", "Oversized", "close_fds"]
