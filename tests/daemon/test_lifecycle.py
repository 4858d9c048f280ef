"""The daemon's life: readiness, shutdown with requests in flight, the watchdog, socket
activation, who may connect, and a second daemon on a socket that is taken."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from prefixd.client import Client
from prefixd.errors import PrefixdError
from prefixd.wire.frames import encode_frame
from prefixd.wire.region import SharedRegion

from .conftest import (
    DEADLINE_S,
    IDENTITY,
    IDENTITY_DICT,
    NOBODY,
    Daemon,
    DaemonFactory,
    Raw,
    as_nobody,
    error_of,
    payload,
    wait_for,
)

BT = IDENTITY.block_tokens


def _wait_exit(daemon: Daemon, timeout: float = DEADLINE_S) -> int | None:
    assert daemon.proc is not None
    try:
        return daemon.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def _server_stats(daemon: Daemon) -> dict[str, Any]:
    with Client(daemon.socket) as observer:
        server: dict[str, Any] = observer.stats()["server"]
        return server


def _stuck_replies(conn: Raw, n: int = 24) -> list[int]:
    """Requests whose replies cannot all be sent while we do not read: each reply is ~120 KiB, far
    more than the socket buffers hold, so the daemon has requests in flight until we read."""
    prompts = [{"tokens": b""}] * 4096
    ids = list(range(100, 100 + n))
    conn.sock.sendall(
        b"".join(
            encode_frame({"id": i, "op": "lookup", "identity": IDENTITY_DICT, "prompts": prompts})
            for i in ids
        )
    )
    return ids


def _wait_answered(daemon: Daemon, lookups: int = 24, loads: int = 0) -> None:
    """Until the daemon has read and answered that many requests (counted before their replies
    are sent): what is left in flight is sending the replies."""

    def answered() -> bool:
        server = _server_stats(daemon)
        return bool(
            server.get("requests.lookup", 0) >= lookups and server.get("requests.load", 0) >= loads
        )

    wait_for(answered, "the daemon answering every request sent")


# --- shutdown ----------------------------------------------------------------------------------


def test_sigterm_lets_requests_in_flight_finish(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--shutdown-grace-s", "3600")
    big = np.arange(16 * BT, dtype=np.uint32) + 77
    pays = [payload(77, i, 1 << 20) for i in range(16)]  # 16 MiB
    with Client(daemon.socket, region_bytes=17 << 20) as writer:
        writer.put(IDENTITY, big, pays)
    region = SharedRegion(17 << 20)
    try:
        with Raw(daemon.socket, timeout=DEADLINE_S) as conn:
            conn.hello()
            assert conn.request("attach", fds=[region.fd], size=region.size)["region"] == 1
            ids = _stuck_replies(conn)
            load = {
                "id": 999,
                "op": "load",
                "identity": IDENTITY_DICT,
                "tokens": big.astype("<u4").tobytes(),
                "region": 1,
            }
            conn.sock.sendall(encode_frame(load))
            _wait_answered(daemon, loads=1)  # the replies wait for us to read
            daemon.proc.send_signal(signal.SIGTERM)
            daemon.wait_notify(b"STOPPING=1")
            # Draining: no new connections (the socket is gone), but the process waits for us.
            wait_for(lambda: not daemon.socket.exists(), "the socket file removed")
            with pytest.raises(OSError):
                Raw(daemon.socket, timeout=2)
            assert daemon.proc.poll() is None, "exited with replies still in flight"
            replies = {}
            for _ in range(len(ids) + 1):
                reply = conn.recv()  # the daemon is there to send each of them
                replies[reply["id"]] = reply
        assert set(replies) == {*ids, 999}
        assert all(r["ok"] is True for r in replies.values()), [
            r for r in replies.values() if not r["ok"]
        ][:1]
        assert all(len(replies[i]["results"]) == 4096 for i in ids)
        loaded = replies[999]
        assert loaded["n_blocks"] == 16
        offsets = np.frombuffer(loaded["offsets"], "<u8").tolist()
        sizes = np.frombuffer(loaded["sizes"], "<u8").tolist()
        got = [bytes(region.view[o : o + n]) for o, n in zip(offsets, sizes)]
        assert got == pays
    finally:
        region.close()
    assert _wait_exit(daemon) == 0, daemon.log()  # all sent: it ends long before its grace
    assert not daemon.socket.exists()
    assert "forced" not in daemon.log() and "Traceback" not in daemon.log()


def test_a_second_sigterm_forces_a_prompt_exit(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--shutdown-grace-s", "3600")
    with Raw(daemon.socket, timeout=DEADLINE_S) as conn:
        conn.hello()
        _stuck_replies(conn)
        _wait_answered(daemon)
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.wait_notify(b"STOPPING=1")
        assert daemon.proc.poll() is None, "did not wait for the requests in flight"
        daemon.proc.send_signal(signal.SIGTERM)
        code = _wait_exit(daemon)  # far less than the hour of grace the first signal gave
    assert code == 1, (code, daemon.log())  # 1: forced
    assert "forced" in daemon.log()
    assert not daemon.socket.exists()


def test_the_grace_period_ends_a_stuck_drain(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--shutdown-grace-s", "0.5")
    with Raw(daemon.socket, timeout=DEADLINE_S) as conn:
        conn.hello()
        _stuck_replies(conn)  # never read: without the grace period, a drain forever
        _wait_answered(daemon)
        daemon.proc.send_signal(signal.SIGTERM)
        code = _wait_exit(daemon)
    assert code == 0, daemon.log()  # not forced by a second signal: a graceful stop
    assert "grace period over" in daemon.log()


class _WriterLock:
    """Holds the store's LMDB write lock from this process: every write transaction of the
    daemon waits for it, so the store work of a put never ends (a disk that does not answer)."""

    def __init__(self, data_dir: Path) -> None:
        self.env = lmdb.open(str(data_dir), subdir=True, max_dbs=32, create=False)
        self.txn: lmdb.Transaction | None = self.env.begin(write=True)

    def release(self) -> None:
        if self.txn is not None:
            self.txn.abort()
            self.txn = None
            self.env.close()


@pytest.mark.parametrize("ended_by", ["grace", "second-signal"])
def test_shutdown_ends_while_store_work_is_stuck(
    daemon_factory: DaemonFactory, ended_by: str
) -> None:
    """Stuck store work holds shutdown no longer than the grace period (0.5 s), or than a second
    signal when the grace period is an hour."""
    daemon = daemon_factory("--shutdown-grace-s", "0.5" if ended_by == "grace" else "3600")
    kept, stuck = np.arange(3 * BT, dtype=np.uint32) + 11, np.arange(3 * BT, dtype=np.uint32) + 12
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, kept, [payload(11, i) for i in range(3)])  # acknowledged
    lock = _WriterLock(daemon.data_dir)
    writer = Client(daemon.socket, region_bytes=1 << 20, timeout=DEADLINE_S)  # greeted, attached
    outcome: list[object] = []

    def put_stuck() -> None:
        try:
            writer.put(IDENTITY, stuck, [payload(12, i) for i in range(3)])
            outcome.append("acknowledged")
        except (PrefixdError, OSError) as exc:
            outcome.append(exc)

    putting = threading.Thread(target=put_stuck, daemon=True)
    try:
        putting.start()
        # The put's store work has started on a pool thread (the writer has no other request):
        # cancelling the request cannot stop it, and it waits for the lock as long as we hold it.
        wait_for(lambda: _server_stats(daemon)["work_running"] >= 1, "the put running")
        daemon.proc.send_signal(signal.SIGTERM)
        daemon.wait_notify(b"STOPPING=1")
        if ended_by == "second-signal":
            daemon.proc.send_signal(signal.SIGTERM)
        code = _wait_exit(daemon, 30)  # the pool stays stuck: only the daemon giving up ends this
        assert code is not None, f"shutdown waited for stuck store work:\n{daemon.log()}"
        # one signal: a graceful stop, however it ended; two: forced
        assert code == (0 if ended_by == "grace" else 1), daemon.log()
        assert "abandoning" in daemon.log(), daemon.log()
        putting.join(DEADLINE_S)
        assert outcome and outcome[0] != "acknowledged", outcome
    finally:
        lock.release()
        writer.close()
    # What was acknowledged is there; the put that never committed is not; nothing is broken.
    daemon.start()
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        loaded = client.load(IDENTITY, kept)
        assert [bytes(v) for v in loaded.views] == [payload(11, i) for i in range(3)]
        assert client.lookup(IDENTITY, [stuck])[0].n_blocks == 0
        assert client.verify()["problems"] == []
    assert daemon.stop() == 0, daemon.log()


def test_ready_only_once_the_socket_accepts(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(wait=False)
    ready = daemon.wait_notify(b"READY=1")
    with Raw(daemon.socket, timeout=5) as conn:  # right away: must not be refused
        assert conn.hello()["ok"] is True
    assert f"STATUS=serving on {daemon.socket}".encode() in ready.split(b"\n")
    assert os.stat(daemon.socket).st_mode & 0o777 == 0o660
    with Client(daemon.socket) as client:
        client.health()
    messages = daemon.since_start()
    assert sum(b"READY=1" in m.split(b"\n") for m in messages) == 1
    assert not any(b"WATCHDOG=1" in m for m in messages), "watchdog pings without WATCHDOG_USEC"
    assert daemon.stop(signal.SIGINT) == 0
    assert any(b"STOPPING=1" in m.split(b"\n") for m in daemon.since_start())
    # Restarts after a stop: the stale socket file was removed, a fresh one is bound.
    daemon.start()
    with Client(daemon.socket) as client:
        assert client.health()["status"] == "ok"


@pytest.mark.parametrize("own_pid", [True, False], ids=["ours", "inherited"])
def test_watchdog_pings(daemon_factory: DaemonFactory, own_pid: bool) -> None:
    env = {"WATCHDOG_USEC": "200000"}
    if not own_pid:
        env["WATCHDOG_PID"] = "1"  # meant for another process: no pings
    daemon = daemon_factory(env=env)

    def pings() -> int:
        return sum(b"WATCHDOG=1" in m.split(b"\n") for m in daemon.since_start())

    if own_pid:
        wait_for(lambda: pings() >= 5, "5 watchdog pings")
    else:
        # The daemon has lived 5 intervals by its own clock (its loop served this meanwhile):
        # a watchdog would have pinged.
        with Client(daemon.socket) as client:
            wait_for(lambda: client.health()["uptime_s"] >= 1.0, "the daemon up for 1 s")
        assert pings() == 0, daemon.messages
    with Client(daemon.socket) as client:
        assert client.health()["status"] == "ok"


# --- socket activation ---------------------------------------------------------------------------

LAUNCHER = """
import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, "-m", "prefixd", *sys.argv[2:]])
"""


def test_socket_activation(daemon_factory: DaemonFactory, sock_dir: Path) -> None:
    path = sock_dir / "activated.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    inode = os.stat(path).st_ino
    try:
        daemon = daemon_factory(
            launcher=[sys.executable, "-c", LAUNCHER, str(listener.fileno())],
            pass_fds=[listener.fileno()],
            socket_path=path,
        )
        with Client(daemon.socket, region_bytes=1 << 16) as client:
            tokens = np.arange(3 * BT, dtype=np.uint32) + 5
            client.put(IDENTITY, tokens, [payload(5, i) for i in range(3)])
            assert client.lookup(IDENTITY, [tokens])[0].n_blocks == 3
        assert daemon.stop() == 0, daemon.log()
        # The daemon did not unlink (or replace) a socket it did not create ...
        assert path.exists() and os.stat(path).st_ino == inode
        # ... and the listening socket still works: our copy accepts a connection.
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(5)
            probe.connect(str(path))
            listener.settimeout(5)
            accepted, _ = listener.accept()
            accepted.close()
    finally:
        listener.close()


# --- who may connect -----------------------------------------------------------------------------


def _as_nobody(path: Path, groups: list[int]) -> dict[str, Any]:
    """As uid/gid 65534 (with `groups` as supplementary groups), connect and say hello; what the
    child saw comes back as a dict."""

    def hello_twice() -> dict[str, Any]:
        result: dict[str, Any] = {"uid": os.getuid()}
        conn = Raw(path, timeout=5)
        try:
            conn.send({"id": 1, "op": "hello", "protocol": 1})
        except OSError as exc:
            result["send_error"] = str(exc)
        try:
            result["reply"] = conn.recv()
            conn.send({"id": 2, "op": "health"})
            result["second"] = conn.recv()
        except (OSError, ConnectionError) as exc:
            result["closed"] = type(exc).__name__
        else:
            result["closed_after"] = conn.closed_by_peer(0.5)
        return result

    kind, seen = as_nobody(hello_twice, groups)
    return seen if kind == "ok" else {"error": seen}


@pytest.fixture
def open_sock_dir(sock_dir: Path) -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root to switch to another uid")
    os.chmod(sock_dir, 0o755)
    return sock_dir


def test_a_disallowed_peer_is_refused(daemon_factory: DaemonFactory, open_sock_dir: Path) -> None:
    daemon = daemon_factory("--socket-mode", "0666")
    with Client(daemon.socket) as root_client:
        seen = _as_nobody(daemon.socket, [])
        assert seen.get("uid") == NOBODY and "error" not in seen, seen
        code, message = error_of(seen["reply"])
        assert code == "forbidden" and seen["reply"]["id"] is None, seen
        assert str(NOBODY) in message
        assert "second" not in seen, "the connection stayed open after forbidden"
        assert root_client.health()["status"] == "ok"
        stats = root_client.stats()["server"]
        assert stats["refused"] == 1 and stats["open_connections"] == 1
        assert stats.get("requests.hello", 0) == 1  # the refused peer's hello was never read


@pytest.mark.parametrize(
    ("flags", "groups"),
    [(("--allowed-uids", str(NOBODY)), []), (("--allowed-gids", "4321"), [4321])],
    ids=["uid", "supplementary-gid"],
)
def test_an_allowed_peer_is_served(
    daemon_factory: DaemonFactory, open_sock_dir: Path, flags: tuple[str, ...], groups: list[int]
) -> None:
    daemon = daemon_factory("--socket-mode", "0666", *flags)
    seen = _as_nobody(daemon.socket, groups)
    assert "error" not in seen, seen
    assert seen["reply"]["ok"] is True, seen
    assert seen["second"]["ok"] is True and seen["second"]["status"] == "ok", seen
    with Client(daemon.socket) as client:
        assert client.stats()["server"].get("refused", 0) == 0


# --- a second daemon -----------------------------------------------------------------------------


@pytest.mark.parametrize("same_data_dir", [True, False], ids=["same-data", "other-data"])
def test_a_second_daemon_does_not_steal_the_socket(
    daemon_factory: DaemonFactory, same_data_dir: bool
) -> None:
    first = daemon_factory(name="first")
    with Client(first.socket, region_bytes=1 << 16) as client:
        tokens = np.arange(2 * BT, dtype=np.uint32) + 9
        client.put(IDENTITY, tokens, [payload(9, i) for i in range(2)])
        inode = os.stat(first.socket).st_ino
        second = daemon_factory(
            name="second",
            wait=False,
            socket_path=first.socket,
            data_dir=first.data_dir if same_data_dir else None,
        )
        code = _wait_exit(second)
        assert code is not None and code != 0, second.log()
        # the socket is looked at first, so a refused start leaves no store files behind
        assert "another daemon is serving" in second.log()
        assert not any(b"READY=1" in m for m in second.since_start())
        assert os.stat(first.socket).st_ino == inode
        # The first daemon and this client's connection carry on.
        assert client.lookup(IDENTITY, [tokens])[0].n_blocks == 2
        with Client(first.socket) as fresh:
            assert fresh.health()["connections"] == 2
    assert first.stop() == 0
