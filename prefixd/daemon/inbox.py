"""A connection's incoming bytes cut into frames, without I/O (one read-ahead buffer: a header, its
body and the frames behind it come in with one recvmsg).

Descriptors belong to the frame they came with: Linux ends a recvmsg right after the bytes sent with
them, so one read's descriptors belong to the frame holding its last byte. Descriptors no frame took
are closed, and so is everything pending past MAX_FDS_PER_FRAME or when truncated.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import NamedTuple

from prefixd.wire.frames import MAX_FDS_PER_FRAME, READ_AHEAD_BYTES, FrameReader


class Frame(NamedTuple):
    """A whole frame: its body (valid until the next `space()`) and descriptors."""

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
    def __init__(self, size: int = READ_AHEAD_BYTES) -> None:
        self._frames = FrameReader(max_body=1 << 62, size=size)  # next_frame applies the limit
        self._received = 0  # stream bytes received in all
        self._fds: list[tuple[int, list[int]]] = []  # (offset of the read's last byte, fds)

    @property
    def empty(self) -> bool:
        """At a frame boundary."""
        return self._frames.empty

    @property
    def skipping(self) -> bool:
        return self._frames.skipping

    @property
    def fds_pending(self) -> bool:
        return bool(self._fds)

    def space(self) -> memoryview:
        return self._frames.space()

    def filled(self, n: int, fds: Sequence[int] = (), truncated: bool = False) -> None:
        """`n` bytes were read into the last `space()`, with these descriptors."""
        self._received += n
        skipping = self._frames.skipping
        self._frames.filled(n)
        if fds:
            self._fds.append((self._received - 1, list(fds)))
        if skipping:
            self._skipped()
        if truncated or sum(len(batch) for _, batch in self._fds) > MAX_FDS_PER_FRAME:
            self.close_pending()  # never hoard a flood of descriptors

    def next_frame(self, max_body: int) -> Frame | Oversized | None:
        frames = self._frames
        length = frames.claimed()
        if length is not None and length > max_body:
            return Oversized(length)
        begin = frames.offset
        body = frames.next_body()
        if body is None:
            return None
        return Frame(body, self._take_fds(begin, frames.offset))

    def skip(self, length: int) -> None:
        """Drop the oversized frame `next_frame` reported."""
        assert self._frames.claimed() == length
        self._frames.skip()
        self._skipped()

    def close_pending(self) -> None:
        for _, batch in self._fds:
            close_fds(batch)
        self._fds.clear()

    def _skipped(self) -> None:
        if not self._frames.skipping:
            offset = self._frames.offset
            self._take_fds(offset, offset)

    def _take_fds(self, begin: int, end: int) -> list[int]:
        """The descriptors of the frame at [begin, end); earlier ones are closed."""
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
