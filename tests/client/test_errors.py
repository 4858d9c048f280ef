"""Errors through the socket: every error code raises its class in both clients; timeouts,
lost connections and restarts are PrefixdError subclasses; reconnects can wait for a daemon."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import struct
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from prefixd.client import AsyncClient, Client
from prefixd.errors import (
    DaemonUnavailableError,
    PrefixdError,
    RemoteError,
    RequestTimeoutError,
)
from prefixd.wire.errors import ERROR_CLASSES, ErrorCode, code_of, error_for
from prefixd.wire.region import fds_from_ancillary
from tests.daemon.conftest import IDENTITY, Daemon

from .harness import KINDS, opener, settle

_HEADER = struct.Struct(">I")


class FakeDaemon:
    """Greets like a daemon, then answers every request with the error `code` (or, for
    "silent", never answers)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.code = "internal"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(16)
        self.connections: list[socket.socket] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _recv(self, conn: socket.socket, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk, ancillary, _, _ = conn.recvmsg(n - len(data), socket.CMSG_SPACE(16))
            for fd in fds_from_ancillary(ancillary):
                os.close(fd)
            if not chunk:
                raise ConnectionError
            data += chunk
        return data

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                (length,) = _HEADER.unpack(self._recv(conn, 4))
                message = msgpack.unpackb(self._recv(conn, length), raw=False)
                rid, op = message["id"], message["op"]
                if op == "hello":
                    reply = {
                        "id": rid,
                        "ok": True,
                        "protocol": 1,
                        "server": "fake",
                        "ops": [],
                        "max_frame_bytes": 1 << 20,
                        "max_region_bytes": 1 << 30,
                        "instance": "fake",
                    }
                elif op == "attach":
                    reply = {"id": rid, "ok": True, "region": 1, "size": message["size"]}
                elif self.code == "silent":
                    continue
                elif self.code == "hang_up":
                    conn.close()
                    return
                elif self.code == "huge":  # a reply claiming 2 GiB, which never comes
                    conn.sendall(_HEADER.pack(2 << 30) + b"\x80" * 16)
                    continue
                else:
                    error = {"code": self.code, "message": f"the {self.code} case"}
                    reply = {"id": rid, "ok": False, "error": error}
                body = msgpack.packb(reply, use_bin_type=True)
                conn.sendall(_HEADER.pack(len(body)) + body)
        except (ConnectionError, OSError):
            return

    def close(self) -> None:
        self.listener.close()
        for conn in self.connections:
            conn.close()


@pytest.fixture
def fake() -> Iterator[FakeDaemon]:
    directory = Path(tempfile.mkdtemp(prefix="pdfake", dir="/tmp"))
    daemon = FakeDaemon(directory / "fake.sock")
    try:
        yield daemon
    finally:
        daemon.close()
        (directory / "fake.sock").unlink(missing_ok=True)
        directory.rmdir()


def test_every_code_has_one_class_and_back() -> None:
    assert set(ERROR_CLASSES) == set(ErrorCode)
    for code, kind in ERROR_CLASSES.items():
        assert kind.code == code.value
        error = error_for(code.value, "why")
        assert type(error) is kind and error.message == "why" and error.code == code.value
        assert code_of(error) is code  # and what the daemon raises maps back to the code
    assert isinstance(error_for("a_newer_code", "x"), RemoteError)


@pytest.mark.parametrize("kind", KINDS)
def test_each_error_code_raises_its_class_through_the_socket(fake: FakeDaemon, kind: str) -> None:
    with opener(kind)(fake.path, region_bytes=1 << 16) as client:
        for code, error_class in ERROR_CLASSES.items():
            fake.code = code.value
            with pytest.raises(PrefixdError) as info:
                client.lookup(IDENTITY, [np.arange(8, dtype=np.uint32)])
            assert type(info.value) is error_class, code
            assert f"the {code.value} case" in str(info.value)
        fake.code = "from_the_future"
        with pytest.raises(RemoteError) as unknown:
            client.stats()
        assert unknown.value.code == "from_the_future"


@pytest.mark.parametrize("kind", KINDS)
def test_a_daemon_that_does_not_answer_is_a_request_timeout(fake: FakeDaemon, kind: str) -> None:
    fake.code = "silent"
    # The timeout only has to let the fake's greeting through on a busy machine.
    with opener(kind)(fake.path, region_bytes=1 << 16, timeout=1.0) as client:
        with pytest.raises(RequestTimeoutError):
            client.load(IDENTITY, np.arange(8, dtype=np.uint32))
        usage = client.region_usage()
        # the load's span may still be written by the daemon that took the request: never reused
        # while the connection that carried it may still deliver (the blocking client drops it,
        # the asyncio one waits for the reply)
        assert usage.leases <= 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_daemon_that_hangs_up_is_unavailable(fake: FakeDaemon, kind: str) -> None:
    fake.code = "hang_up"
    with opener(kind)(fake.path, region_bytes=1 << 16) as client:
        with pytest.raises(DaemonUnavailableError):
            client.load(IDENTITY, np.arange(8, dtype=np.uint32))
        assert client.region_usage().quarantined_bytes > 0  # the same daemon may still write
    with pytest.raises(DaemonUnavailableError, match="cannot connect"):
        Client(fake.path.with_name("nothing.sock"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_reply_longer_than_any_reply_drops_the_connection(fake: FakeDaemon, kind: str) -> None:
    """Nothing is allocated for a length no reply can have; the call fails at once (rather than
    at its timeout, waiting for 2 GiB) and the connection, out of step, is dropped."""
    fake.code = "huge"
    with opener(kind)(fake.path, region_bytes=1 << 16, timeout=60.0) as client:
        with pytest.raises(DaemonUnavailableError, match="frame"):
            client.lookup(IDENTITY, [np.arange(8, dtype=np.uint32)])
        fake.code = "internal"  # the client reconnects and carries on
        with pytest.raises(PrefixdError, match="the internal case"):
            client.stats()


def test_reconnect_waits_for_a_restarting_daemon(daemon: Daemon) -> None:
    prompt = np.arange(8 * IDENTITY.block_tokens, dtype=np.uint32)
    with (
        Client(daemon.socket, region_bytes=1 << 16, reconnect_wait_s=30) as waiting,
        Client(daemon.socket) as failing,
    ):
        waiting.put(IDENTITY, prompt, [b"a" * 100] * 8)
        daemon.stop()
        with pytest.raises(DaemonUnavailableError):
            failing.lookup(IDENTITY, [prompt])
        restarter = threading.Timer(0.5, daemon.start)
        restarter.start()
        try:
            [hit] = waiting.lookup(IDENTITY, [prompt])  # waits, with backoff, then succeeds
        finally:
            restarter.join()
        assert hit.n_blocks == 8

        async def scenario() -> int:
            async with AsyncClient(daemon.socket, reconnect_wait_s=30) as client:
                daemon.stop()
                timer = threading.Timer(0.5, daemon.start)
                timer.start()
                try:
                    [again] = await client.lookup(IDENTITY, [prompt])
                finally:
                    timer.join()
                return again.n_blocks

        assert asyncio.run(scenario()) == 8


def test_a_reconnecting_async_client_leaves_no_noise(daemon: Daemon) -> None:
    """Requests lost with a killed daemon raise DaemonUnavailableError to their callers, and
    nothing is left for asyncio to complain about ("exception was never retrieved")."""
    prompt = np.arange(64 * IDENTITY.block_tokens, dtype=np.uint32)
    complaints: list[dict[str, Any]] = []

    async def scenario() -> set[type]:
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: complaints.append(ctx))
        async with AsyncClient(daemon.socket, region_bytes=1 << 20) as client:
            await client.put(IDENTITY, prompt, [b"k" * 4096] * 64)
            calls = [client.load(IDENTITY, prompt) for _ in range(8)]
            calls += [client.lookup(IDENTITY, [prompt]) for _ in range(8)]
            # and requests of about 1 MB each (64 prompts of token ids sent inline): they queue
            # behind each other's writes, so the daemon dies while some are not even sent yet
            inline = [np.arange(4000, dtype=np.uint32) + i for i in range(64)]
            calls += [client.lookup(IDENTITY, inline) for _ in range(32)]
            tasks = [asyncio.ensure_future(c) for c in calls]
            await settle(lambda: bool(client._pending))  # requests are in flight
            daemon.stop(9)  # SIGKILL: the requests in flight are lost
            results = await asyncio.gather(*tasks, return_exceptions=True)
            daemon.start()
            [hit] = await client.lookup(IDENTITY, [prompt])  # reconnects to the new instance
            assert hit.n_blocks == 64
            usage = client.region_usage()
            assert usage is not None and usage.quarantined_bytes == 0  # the old daemon is gone
            # the kinds only: an exception's traceback would keep its call's futures alive
            # past the collection below, hiding what they would complain of
            kinds = {type(result) for result in results if isinstance(result, BaseException)}
            del tasks, calls, results
            return kinds

    kinds = asyncio.run(scenario())
    gc.collect()
    assert kinds <= {DaemonUnavailableError}, kinds
    assert complaints == []


def test_a_refusal_sent_before_the_hello_is_not_lost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon refuses a peer by replying and closing at once. When that happens before the
    client's hello leaves, the hello meets a closed end (EPIPE): the client still reads the
    refusal left in its socket and raises it, not a lost connection."""
    from prefixd.client import blocking
    from prefixd.errors import ForbiddenError
    from prefixd.wire.frames import encode_frame
    from prefixd.wire.messages import error_reply

    path = Path(tempfile.mkdtemp(prefix="pdr", dir="/tmp")) / "d.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)
    closed = threading.Event()

    def refuse() -> None:
        conn, _ = listener.accept()
        conn.sendall(encode_frame(error_reply(None, ErrorCode.FORBIDDEN, "uid 1 may not")))
        conn.close()
        closed.set()

    checked = blocking.check_peer

    def check_then_wait(sock: socket.socket, uids: Any) -> None:
        checked(sock, uids)
        assert closed.wait(30), "the fake daemon never refused"  # the hello leaves after this

    monkeypatch.setattr(blocking, "check_peer", check_then_wait)
    server = threading.Thread(target=refuse)
    server.start()
    try:
        with pytest.raises(ForbiddenError, match="may not"):
            Client(path)
    finally:
        server.join()
        listener.close()
        path.unlink()
        path.parent.rmdir()
