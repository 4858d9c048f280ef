"""Frames: a 4-byte big-endian body length followed by a msgpack map (docs/protocol.md)."""

from __future__ import annotations

import mmap
import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import msgspec

from prefixd.errors import FrameTooLargeError, ProtocolError
from prefixd.wire.errors import ErrorCode

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
MAX_FDS_PER_FRAME = 4
MAX_REPLY_BYTES = 64 << 20  # what a client accepts as one reply body (a load of 4M blocks)
READ_AHEAD_BYTES = 64 << 10


def _enc_hook(value: Any) -> Any:
    """What msgpack-python packs and msgspec does not: numpy's floats and integers."""
    if isinstance(value, float):
        return float(value)
    index = getattr(value, "__index__", None)
    if index is not None:
        return index()
    raise NotImplementedError(f"cannot encode a {type(value).__name__}")


_STRUCTS = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_frame(message: Mapping[str, Any] | msgspec.Struct) -> bytes:
    """A whole frame: a message struct (see prefixd.wire.decoding.encode) or a plain map."""
    body: bytes
    if isinstance(message, msgspec.Struct):
        body = _STRUCTS.encode(message)
    else:
        body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes | memoryview) -> dict[str, Any]:
    """A frame body as a plain map, untyped (the daemon decodes requests with
    prefixd.wire.decoding.decode_request); raises ProtocolError(BAD_FRAME) on anything else."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack ({exc})") from None
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "body is not a map")
    return message


class FrameReader:
    """Cuts a byte stream into frame bodies, without I/O: a shell reads into `space()`, reports
    `filled(n)` and takes bodies from `next_body()`. Reading ahead brings a header and its body
    in with one recv, not two. A body is a view valid until the next `space()` (one too long for
    the buffer gets its own). A length over `max_body` raises FrameTooLargeError unless the
    shell `skip()`s it after `claimed()`; `offset`, the stream offset of the next frame, tells
    which bytes (and so which descriptors) a body came in."""

    def __init__(self, *, max_body: int = MAX_REPLY_BYTES, size: int = READ_AHEAD_BYTES) -> None:
        self.max_body = max_body
        self._buffer = memoryview(bytearray(size))
        self._start = 0  # the first byte not yet handed out
        self._end = 0  # the end of the bytes read
        self._large: memoryview | None = None  # the body being read into a buffer of its own
        self._large_have = 0
        self._skip = 0  # bytes of a skipped frame still to drop
        self.offset = 0  # the stream offset of the next frame (of the large body's, when one)

    @property
    def empty(self) -> bool:
        """Nothing buffered: the stream stands at a frame boundary."""
        return self._start == self._end and self._large is None and not self._skip

    @property
    def skipping(self) -> bool:
        """Dropping a skipped frame's bytes as they come."""
        return bool(self._skip)

    def space(self) -> memoryview:
        """Where the next read goes (never empty)."""
        if self._large is not None:
            return self._large[self._large_have :]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._start and self._end == len(self._buffer):  # move the partial frame up front
            pending = self._end - self._start
            self._buffer[:pending] = self._buffer[self._start : self._end]
            self._start, self._end = 0, pending
        return self._buffer[self._end :]

    def filled(self, n: int) -> None:
        """`n` bytes were read into the last `space()`."""
        if self._large is not None:
            self._large_have += n
        else:
            self._end += n
            if self._skip:
                self._drop()

    def claimed(self) -> int | None:
        """The body length the next frame's header claims, once the header is in."""
        if self._large is not None or self._skip or self._end - self._start < HEADER.size:
            return None
        (length,) = HEADER.unpack_from(self._buffer, self._start)
        return int(length)

    def skip(self) -> None:
        """Drop the next frame, whose header `claimed()` read: its header and body, as they come."""
        length = self.claimed()
        assert length is not None
        self._start += HEADER.size
        self.offset += HEADER.size
        self._skip = length
        self._drop()

    def next_body(self) -> memoryview | None:
        """The next whole frame body read, or None until more bytes come."""
        large = self._large
        if large is not None:
            if self._large_have < len(large):
                return None
            self._large = None
            self.offset += HEADER.size + len(large)
            return large
        length = self.claimed()
        if length is None:
            return None
        if length > self.max_body:
            raise FrameTooLargeError(
                ErrorCode.FRAME_TOO_LARGE, f"a {length}-byte frame (the limit is {self.max_body})"
            )
        begin = self._start + HEADER.size
        if begin + length <= self._end:
            self._start = begin + length
            self.offset += HEADER.size + length
            return self._buffer[begin : begin + length]
        if HEADER.size + length <= len(self._buffer):
            return None  # it fits the buffer: wait for the rest
        # Anonymous memory is taken page by page as the body comes: a header alone costs nothing
        # (a bytearray would zero, and so hold, all `length` bytes at once).
        body = memoryview(mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE))
        got = self._end - begin
        body[:got] = self._buffer[begin : self._end]
        self._start = self._end = 0
        self._large, self._large_have = body, got
        return None

    def _drop(self) -> None:
        dropped = min(self._skip, self._end - self._start)
        self._start += dropped
        self.offset += dropped
        self._skip -= dropped
