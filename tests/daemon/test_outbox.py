"""A connection's replies reach the client whole and in order, whoever sends them: once the socket
cuts a frame short, the rest of it and every later frame wait in the outbox, so a reply sent from
the reader callback can never slip into the middle of another (prefixd.daemon.outbox)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import Counter
from types import SimpleNamespace

import msgpack

from prefixd.config.settings import Limits
from prefixd.daemon.connection import Connection
from prefixd.daemon.outbox import Outbox
from prefixd.wire.frames import HEADER, encode_frame


def frames(count: int, size: int) -> list[bytes]:
    return [bytes([i % 251]) * size for i in range(count)]


async def read(sock: socket.socket, into: bytearray, total: int) -> None:
    """Read until `into` holds `total` bytes, waiting on the socket's readiness (the loop runs
    the outbox's writer callback meanwhile)."""
    loop = asyncio.get_running_loop()
    while len(into) < total:
        into.extend(await loop.sock_recv(sock, 1 << 20))


def test_frames_cut_short_keep_their_order() -> None:
    async def run() -> tuple[bytes, list[bytes]]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.setblocking(False)
        theirs.setblocking(False)
        outbox = Outbox(ours, loop)
        big = frames(64, 64 << 10)  # far more than the socket holds: some are cut short
        small = frames(8, 10)  # sent while big ones wait, as a reader-callback reply would be
        sent = [*big[:8], *small[:4], *big[8:], *small[4:]]
        waits = [outbox.send(frame) for frame in sent]
        assert any(w is not None and not w.done() for w in waits)  # some wait their turn
        got = bytearray()

        await asyncio.wait_for(read(theirs, got, sum(map(len, sent))), 60)  # stalled: fails
        await asyncio.wait_for(asyncio.gather(*(w for w in waits if w is not None)), 5)
        ours.close()
        theirs.close()
        return bytes(got), sent

    got, sent = asyncio.run(run())
    assert got == b"".join(sent)


def test_a_closed_outbox_lets_its_senders_go() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.setblocking(False)
        outbox = Outbox(ours, loop)
        waits = [outbox.send(frame) for frame in frames(4, 1 << 20)]  # the peer never reads
        pending = [w for w in waits if w is not None]
        assert pending and not any(w.done() for w in pending)
        outbox.close()  # the connection ends: nobody waits for ever
        await asyncio.wait_for(asyncio.gather(*pending), 5)
        assert outbox.send(b"late") is None  # dropped: nothing is sent after close
        ours.close()
        theirs.close()

    asyncio.run(run())


def test_a_reply_cut_short_is_not_overtaken_by_the_next() -> None:
    """The connection's own sends: a reply answered in the reader callback that the socket cuts
    short, then another reply before the loop runs again. The second must wait for the rest of
    the first (it used to go out at once, into the middle of the first frame)."""

    async def run() -> bytes:
        ours, theirs = socket.socketpair()
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        ours.setblocking(False)
        theirs.setblocking(False)
        config = SimpleNamespace(limits=Limits())
        server = SimpleNamespace(config=config, stats=Counter())
        operations = SimpleNamespace(services=SimpleNamespace(pinned_bytes=Counter()))
        conn = Connection(server, operations, ours, pid=1, uid=0)  # type: ignore[arg-type]
        first = {"id": 1, "ok": True, "blob": b"a" * (256 << 10)}
        second = {"id": 2, "ok": True}
        conn._reply_now(first)  # type: ignore[arg-type]
        got = bytearray()
        with contextlib.suppress(BlockingIOError):
            while True:  # the client reads what came: the socket has room for a small frame
                got.extend(theirs.recv(1 << 20))
        conn._reply_now(second)  # type: ignore[arg-type]
        total = len(encode_frame(first)) + len(encode_frame(second))
        await asyncio.wait_for(read(theirs, got, total), 60)  # stalled: fails, never hangs
        await asyncio.wait_for(asyncio.gather(*conn._requests), 5)
        ours.close()
        theirs.close()
        return bytes(got)

    stream = asyncio.run(run())
    replies = []
    while stream:  # the client's framing: length, then the body
        (length,) = HEADER.unpack(stream[: HEADER.size])
        replies.append(msgpack.unpackb(stream[HEADER.size : HEADER.size + length]))
        stream = stream[HEADER.size + length :]
    assert [r["id"] for r in replies] == [1, 2]
    assert replies[0]["blob"] == b"a" * (256 << 10)
