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

from prefixd.wire.frames import MAX_FDS_PER_FRAME, READ_AHEAD_BYTES, FrameReader


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
    """The bytes read from one connection and not yet handed out as frames: the framing is
    FrameReader's, the descriptors are kept here by the stream offset they came at."""

    def __init__(self, size: int = READ_AHEAD_BYTES) -> None:
        self._frames = FrameReader(max_body=1 << 62, size=size)  # next_frame applies the limit
        self._received = 0  # stream bytes received in all
        self._fds: list[tuple[int, list[int]]] = []  # (offset of the read's last byte, fds)

    @property
    def empty(self) -> bool:
        """Nothing buffered: the stream stands at a frame boundary."""
        return self._frames.empty

    @property
    def skipping(self) -> bool:
        """Dropping a refused frame's bytes as they come."""
        return self._frames.skipping

    @property
    def fds_pending(self) -> bool:
        return bool(self._fds)

    def space(self) -> memoryview:
        """Where the next read goes (never empty)."""
        return self._frames.space()

    def filled(self, n: int, fds: Sequence[int] = (), truncated: bool = False) -> None:
        """`n` bytes (n > 0) were read into the last `space()`, with these descriptors."""
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
        """The next whole frame, an oversized one's length, or None until more bytes come."""
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
        """Drop the oversized frame `next_frame` reported (its header and `length` bytes)."""
        assert self._frames.claimed() == length
        self._frames.skip()
        self._skipped()

    def close_pending(self) -> None:
        for _, batch in self._fds:
            close_fds(batch)
        self._fds.clear()

    def _skipped(self) -> None:
        """Once a refused frame is dropped whole, close what came with it."""
        if not self._frames.skipping:
            offset = self._frames.offset
            self._take_fds(offset, offset)

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
