"""The daemon's read-ahead framing (prefixd.daemon.inbox): frames cut from reads of any size,
descriptors handed to the frame whose bytes they came with, refused frames dropped whole."""

from __future__ import annotations

import os

from prefixd.daemon.inbox import Frame, Inbox, Oversized
from prefixd.wire.frames import HEADER, MAX_FDS_PER_FRAME


def _frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def _feed(
    inbox: Inbox, data: bytes, fds: list[int] | None = None, limit: int = 1 << 20
) -> list[tuple[bytes, list[int]]]:
    """Write `data` into the inbox as the daemon reads, a space at a time (the last read with
    `fds`), taking the whole frames after each read; the frames taken."""
    out: list[tuple[bytes, list[int]]] = []
    while data:
        space = inbox.space()
        n = min(len(space), len(data))
        space[:n] = data[:n]
        data = data[n:]
        inbox.filled(n, (fds or []) if not data else [])
        while isinstance(frame := inbox.next_frame(limit), Frame):
            out.append((bytes(frame.body), frame.fds))
    return out


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_pipelined_frames_come_out_of_one_read_and_a_split_one_waits() -> None:
    inbox = Inbox(size=64)
    got = _feed(inbox, _frame(b"a" * 10) + _frame(b"b" * 20) + _frame(b"c" * 30)[:7])
    assert got == [(b"a" * 10, []), (b"b" * 20, [])]
    assert not inbox.empty
    assert _feed(inbox, _frame(b"c" * 30)[7:]) == [(b"c" * 30, [])]
    assert inbox.empty


def test_a_frame_longer_than_the_buffer_gets_a_body_of_its_own() -> None:
    inbox = Inbox(size=64)
    body = bytes(range(256)) * 4
    assert _feed(inbox, _frame(body) + _frame(b"next")) == [(body, []), (b"next", [])]


def test_descriptors_go_to_the_frame_holding_the_reads_last_byte() -> None:
    """A read that brings the end of one frame and the whole of the next with descriptors:
    they are the second frame's, not the first's (the first came without any)."""
    inbox = Inbox(size=256)
    r, w = os.pipe()
    try:
        first, second = _frame(b"x" * 40), _frame(b"y" * 10)
        assert _feed(inbox, first[:20]) == []
        assert _feed(inbox, first[20:] + second, fds=[r]) == [(b"x" * 40, []), (b"y" * 10, [r])]
    finally:
        os.close(r)
        os.close(w)


def test_descriptors_of_a_dropped_frame_are_closed_and_a_flood_is_refused() -> None:
    inbox = Inbox(size=64)
    r, w = os.pipe()
    big = _frame(b"z" * 100)
    assert _feed(inbox, big[:30], fds=[r], limit=50) == []
    assert inbox.next_frame(50) == Oversized(100)
    inbox.skip(100)
    assert _feed(inbox, big[30:] + _frame(b"ok"), limit=50) == [(b"ok", [])]
    assert inbox.empty and not _is_open(r)  # closed with the frame it came with
    many = [os.dup(w) for _ in range(MAX_FDS_PER_FRAME + 1)]
    assert _feed(inbox, _frame(b"attach"), fds=many) == [(b"attach", [])]
    assert not any(_is_open(fd) for fd in many)
    os.close(w)
