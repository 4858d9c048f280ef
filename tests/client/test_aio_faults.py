"""AsyncClient when the daemon stalls, restarts or a task is cancelled (prefixd.client.aio): a
cancelled request holds no region space and leaves no half frame on the connection, a send the
daemon does not read ends within the timeout, and after a reconnect nothing goes out before the
greeting (hello, then the region's attach) is answered. Against a real daemon where it can show
the fault (SIGSTOP), else a scripted one (FakeDaemon) answering the protocol's frames."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from prefixd.client import AsyncClient
from prefixd.errors import RequestTimeoutError

from ..daemon.conftest import IDENTITY, Daemon
from ..waiting import DEADLINE_S

HEADER = struct.Struct(">I")
SMALL = np.arange(8, dtype=np.uint32)
BIG = (
    np.arange(1 << 20, dtype=np.uint32) % 50_000
)  # a 4 MiB inline prompt: more than a socket holds


class Peer:
    """One connection of the fake daemon: frames in, replies out, the ops it read."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""
        self.ops: list[str] = []

    def read(self) -> dict[str, Any]:
        while len(self.buffer) < 4 or len(self.buffer) < 4 + HEADER.unpack(self.buffer[:4])[0]:
            data, ancillary, _, _ = self.sock.recvmsg(1 << 20, socket.CMSG_SPACE(16))
            for _level, _kind, raw in ancillary:  # a region's memfd: not needed here
                for fd in struct.unpack(f"{len(raw) // 4}i", raw[: len(raw) // 4 * 4]):
                    os.close(fd)
            if not data:
                raise EOFError
            self.buffer += data
        (size,) = HEADER.unpack(self.buffer[:4])
        body, self.buffer = self.buffer[4 : 4 + size], self.buffer[4 + size :]
        message: dict[str, Any] = msgpack.unpackb(body, raw=False, strict_map_key=False)
        self.ops.append(message["op"])
        return message

    def send(self, message: dict[str, Any]) -> None:
        body = msgpack.packb(message, use_bin_type=True)
        self.sock.sendall(HEADER.pack(len(body)) + body)

    def greet(self, hello: dict[str, Any], instance: str) -> None:
        assert hello["op"] == "hello", hello
        self.send({
            "id": hello["id"], "ok": True, "protocol": 1, "server": "fake", "ops": [],
            "max_frame_bytes": 1 << 30, "max_region_bytes": 1 << 30, "instance": instance,
        })  # fmt: skip

    def answer(self, message: dict[str, Any], attached: bool = True) -> None:
        """What the daemon answers: a region attached, no hit; a region not attached refused."""
        rid, op = message["id"], message["op"]
        if op == "attach":
            self.send({"id": rid, "ok": True, "region": 1, "size": message["size"]})
        elif op == "load" and not attached:
            error = {"code": "bad_region", "message": "no region 1 on this connection"}
            self.send({"id": rid, "ok": False, "error": error})
        elif op == "lookup":
            empty = {"n_blocks": 0, "n_tokens": 0, "sizes": b""}
            self.send({"id": rid, "ok": True, "results": [empty] * len(message["prompts"])})
        elif op == "load":
            self.send({"id": rid, "ok": True, "n_blocks": 0, "n_tokens": 0, "offsets": b"",
                       "sizes": b""})  # fmt: skip


class FakeDaemon:
    """Serves the n-th connection with `script(peer, n)` on a thread of its own."""

    def __init__(self, path: Path, script: Callable[[Peer, int], None]) -> None:
        self.path = path
        self.peers: list[Peer] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self._script = script
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            peer = Peer(sock)
            self.peers.append(peer)
            serve = threading.Thread(target=self._serve, args=(peer, len(self.peers) - 1))
            serve.daemon = True
            serve.start()

    def _serve(self, peer: Peer, index: int) -> None:
        try:
            self._script(peer, index)
        except (EOFError, OSError):
            pass

    def close(self) -> None:
        self.listener.close()
        for peer in self.peers:
            peer.sock.close()


FakeDaemons = Callable[..., FakeDaemon]


@pytest.fixture
def fake_daemon(tmp_path: Path) -> Iterator[FakeDaemons]:
    """`fake_daemon(script, *holds)`: a FakeDaemon on the test's socket, closed after the test
    with each of `holds` (the events its script waits on) set, so no script waits on."""
    started: list[tuple[FakeDaemon, tuple[threading.Event, ...]]] = []

    def start(script: Callable[[Peer, int], None], *holds: threading.Event) -> FakeDaemon:
        fake = FakeDaemon(tmp_path / "fake.sock", script)
        started.append((fake, holds))
        return fake

    yield start
    for fake, holds in started:
        for hold in holds:
            hold.set()
        fake.close()


async def until(condition: Callable[[], object]) -> None:
    """Yield to the loop until `condition` holds (each task runs up to its next wait)."""
    async with asyncio.timeout(DEADLINE_S):
        while not condition():
            await asyncio.sleep(0.001)


def test_a_request_cancelled_before_it_went_holds_no_region_space(
    fake_daemon: FakeDaemons,
) -> None:
    reading = threading.Event()

    def script(peer: Peer, index: int) -> None:
        peer.greet(peer.read(), "one")
        peer.answer(peer.read())  # the region's attach
        assert reading.wait(DEADLINE_S)  # busy: reads nothing until told
        while True:
            peer.answer(peer.read())

    fake = fake_daemon(script, reading)

    async def run() -> Any:
        client = await AsyncClient.connect(
            fake.path, region_bytes=1 << 20, token_region_bytes=0, timeout=DEADLINE_S
        )
        big = asyncio.create_task(client.lookup(IDENTITY, [BIG]))  # its send waits on the peer
        await until(client._write_lock.locked)
        load = asyncio.create_task(client.load(IDENTITY, SMALL, length=4096))
        # leased, the load runs on in the same step to the wait for the connection's turn
        await until(lambda: getattr(client.region_usage(), "leased_bytes", 0) == 4096)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        reading.set()
        await big
        await client.lookup(IDENTITY, [SMALL])
        usage = client.region_usage()
        await client.close()
        return usage

    usage = asyncio.run(run())
    assert usage.leased_bytes == 0 and usage.quarantined_bytes == 0, usage
    assert fake.peers[0].ops == ["hello", "attach", "lookup", "lookup"]  # the load never went


def test_a_request_cancelled_while_it_was_sent_leaves_no_half_frame(daemon: Daemon) -> None:
    async def run() -> list[int]:
        # well under the daemon's 30 s frame timeout, which would end a connection left with
        # half a frame and so hide it
        client = await AsyncClient.connect(
            daemon.socket, region_bytes=1 << 20, token_region_bytes=0, timeout=5.0
        )
        os.kill(daemon.pid, signal.SIGSTOP)  # reads nothing: the big frame goes part way
        try:
            big = asyncio.create_task(client.lookup(IDENTITY, [BIG]))
            await until(client._write_lock.locked)  # held: part of the frame went, it waits on
            big.cancel()
            with pytest.raises(asyncio.CancelledError):
                await big
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        found = [(await client.lookup(IDENTITY, [SMALL]))[0].n_blocks for _ in range(3)]
        await client.close()
        return found

    assert asyncio.run(run()) == [0, 0, 0]  # answered: no later frame read as the rest of it


def test_a_send_the_daemon_does_not_read_ends_within_the_timeout(
    fake_daemon: FakeDaemons,
) -> None:
    done = threading.Event()

    def script(peer: Peer, index: int) -> None:
        peer.greet(peer.read(), "one")
        peer.answer(peer.read())
        done.wait(DEADLINE_S)  # then reads nothing

    fake = fake_daemon(script, done)

    async def run() -> None:
        client = await AsyncClient.connect(
            fake.path, region_bytes=1 << 20, token_region_bytes=0, timeout=0.5
        )
        try:
            async with asyncio.timeout(DEADLINE_S):  # not for ever
                with pytest.raises(RequestTimeoutError):
                    await client.lookup(IDENTITY, [BIG])
        finally:
            await client.close()

    asyncio.run(run())


def test_after_a_reconnect_nothing_goes_before_the_greeting_is_answered(
    fake_daemon: FakeDaemons,
) -> None:
    restart, hello_read, answer_hello = threading.Event(), threading.Event(), threading.Event()

    def script(peer: Peer, index: int) -> None:
        if index == 0:
            peer.greet(peer.read(), "one")
            peer.answer(peer.read())
            assert restart.wait(DEADLINE_S)
            peer.sock.close()  # the daemon restarts
            return
        hello = peer.read()
        hello_read.set()
        assert answer_hello.wait(DEADLINE_S)  # a hello that takes a while
        peer.greet(hello, "two")
        attached = False
        while True:
            message = peer.read()
            attached = attached or message["op"] == "attach"
            peer.answer(message, attached)

    fake = fake_daemon(script, restart, answer_hello)

    async def run() -> Any:
        client = await AsyncClient.connect(
            fake.path, region_bytes=1 << 20, token_region_bytes=0, timeout=DEADLINE_S
        )
        restart.set()
        await until(lambda: client._sock is None)  # the reader saw the connection end
        first = asyncio.create_task(client.lookup(IDENTITY, [SMALL]))  # it reconnects
        await until(hello_read.is_set)
        second = asyncio.create_task(client.load(IDENTITY, SMALL, length=4096))
        # leased, the load runs on in the same step to the wait for the connection
        await until(lambda: getattr(client.region_usage(), "leased_bytes", 0) == 4096)
        answer_hello.set()
        outcomes = await asyncio.gather(first, second, return_exceptions=True)
        await client.close()
        return outcomes

    outcomes = asyncio.run(run())
    assert not any(isinstance(o, BaseException) for o in outcomes), outcomes
    assert fake.peers[1].ops[:2] == ["hello", "attach"], fake.peers[1].ops
