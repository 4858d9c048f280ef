"""FrameReader: whatever way a stream of frames is cut into reads, the bodies come out whole and
in order; a frame longer than the buffer gets a buffer of its own; a length over the limit is
refused before anything is allocated for it."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd.errors import FrameTooLargeError
from prefixd.wire.frames import HEADER, FrameReader, encode_frame


def framed(bodies: list[bytes]) -> bytes:
    return b"".join(HEADER.pack(len(body)) + body for body in bodies)


def feed(reader: FrameReader, stream: bytes, cuts: list[int]) -> list[bytes]:
    """Push `stream` through the reader in reads of at most the sizes in `cuts` (cycled),
    each no longer than the space it offers; the bodies it hands out, copied at once (a body
    is only valid until the next read)."""
    bodies: list[bytes] = []
    at, turn = 0, 0
    while True:
        body = reader.next_body()
        if body is not None:
            bodies.append(bytes(body))
            continue
        if at == len(stream):
            return bodies
        space = reader.space()
        assert len(space) > 0
        n = min(cuts[turn % len(cuts)], len(space), len(stream) - at)
        space[:n] = stream[at : at + n]
        reader.filled(n)
        at += n
        turn += 1


@settings(max_examples=300, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=300), max_size=20),
    cuts=st.lists(st.integers(min_value=1, max_value=700), min_size=1, max_size=8),
    size=st.integers(min_value=8, max_value=512),
)
def test_any_cut_of_a_stream_gives_back_its_bodies(
    bodies: list[bytes], cuts: list[int], size: int
) -> None:
    reader = FrameReader(size=size)
    assert feed(reader, framed(bodies), cuts) == bodies


def test_a_header_and_a_short_body_come_in_one_read() -> None:
    reader = FrameReader()
    frame = encode_frame({"id": 7, "ok": True})
    space = reader.space()
    space[: len(frame)] = frame
    reader.filled(len(frame))
    body = reader.next_body()
    assert body is not None and bytes(body) == frame[HEADER.size :]
    assert reader.next_body() is None


def test_a_body_longer_than_the_buffer_is_read_into_its_own() -> None:
    reader = FrameReader(size=64)
    long = bytes(range(256)) * 4
    assert feed(reader, framed([b"a", long, b"b"]), [50]) == [b"a", long, b"b"]


def test_a_length_over_the_limit_is_refused() -> None:
    reader = FrameReader(max_body=100)
    space = reader.space()
    space[: HEADER.size] = HEADER.pack(101)
    reader.filled(HEADER.size)
    with pytest.raises(FrameTooLargeError, match="101-byte"):
        reader.next_body()


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_long_frames_header_alone_holds_no_memory_for_its_body() -> None:
    """A peer that sends headers claiming the longest body and nothing more must not make the
    daemon hold that much per connection: the body's memory comes as its bytes do."""
    claimed = 16 << 20
    readers = [FrameReader(max_body=claimed) for _ in range(16)]
    before = resident_bytes()
    for reader in readers:
        space = reader.space()
        space[: HEADER.size + 1] = HEADER.pack(claimed) + b"\x81"
        reader.filled(HEADER.size + 1)
        assert reader.next_body() is None
    assert resident_bytes() - before < 16 * claimed // 8  # a page or so each, not 16 MiB
    reader = readers[0]
    body = b"\x81" + bytes(range(256)) * (claimed // 256 - 1) + bytes(255)
    space = reader.space()
    space[:] = body[1:]
    reader.filled(len(space))
    got = reader.next_body()
    assert got is not None and bytes(got) == body
