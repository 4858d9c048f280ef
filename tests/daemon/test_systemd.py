"""The systemd protocols without systemd: a fake notify socket, fds handed over by a launcher."""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from prefixd.daemon.systemd import Watchdog, listen_sockets, notify, watchdog_interval
from prefixd.errors import ConfigError
from tests.waiting import settle

REPO = Path(__file__).resolve().parents[2]
UNITS = ("prefixd.service", "prefixd.socket")
SUN_PATH_MAX = 100  # sun_path is 108 bytes; keep a margin


# --- a fake $NOTIFY_SOCKET ----------------------------------------------------------------------


@pytest.fixture
def short_dir(tmp_path: Path) -> Iterator[Path]:
    """tmp_path, or a short /tmp dir when tmp_path would overflow an AF_UNIX address."""
    if len(str(tmp_path / "notify.sock")) <= SUN_PATH_MAX:
        yield tmp_path
        return
    path = Path(tempfile.mkdtemp(prefix="pfx-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(params=["path", "abstract"])
def notify_socket(
    request: pytest.FixtureRequest, short_dir: Path
) -> Iterator[tuple[str, socket.socket]]:
    """A bound SOCK_DGRAM receiver and the $NOTIFY_SOCKET value that reaches it."""
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(short_dir / "notify.sock")
        receiver.bind(address)
    else:
        name = f"prefixd-test-{secrets.token_hex(8)}"
        receiver.bind("\0" + name)
        address = "@" + name
    receiver.settimeout(2.0)
    with receiver:
        yield address, receiver


def test_notify_delivers_state_as_one_datagram(notify_socket: tuple[str, socket.socket]) -> None:
    address, receiver = notify_socket
    assert notify("READY=1\nSTATUS=serving", {"NOTIFY_SOCKET": address}) is True
    assert receiver.recv(4096) == b"READY=1\nSTATUS=serving"
    receiver.setblocking(False)
    with pytest.raises(BlockingIOError):  # exactly one datagram
        receiver.recv(4096)


def test_notify_reads_os_environ_by_default(
    notify_socket: tuple[str, socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    address, receiver = notify_socket
    monkeypatch.setenv("NOTIFY_SOCKET", address)
    assert notify("STOPPING=1") is True
    assert receiver.recv(4096) == b"STOPPING=1"


def test_notify_without_socket_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False
    assert notify("READY=1", {}) is False
    assert notify("READY=1", {"NOTIFY_SOCKET": ""}) is False


@pytest.mark.parametrize(
    "address", ["/nonexistent/prefixd/notify.sock", "relative.sock", "vsock:2:9"]
)
def test_notify_failure_returns_false(address: str) -> None:
    assert notify("READY=1", {"NOTIFY_SOCKET": address}) is False


def test_notify_failure_to_a_stream_socket_returns_false(short_dir: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as wrong_type:
        wrong_type.bind(str(short_dir / "stream.sock"))
        wrong_type.listen()
        assert notify("READY=1", {"NOTIFY_SOCKET": str(short_dir / "stream.sock")}) is False


def test_notify_rejects_an_empty_state() -> None:
    with pytest.raises(ValueError):
        notify("", {"NOTIFY_SOCKET": "/nonexistent"})


# --- watchdog_interval --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "2000000"}, 1.0),
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "<self>"}, 1.0),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "<other>"}, None),
        ({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "garbage"}, None),
        ({}, None),
        ({"WATCHDOG_PID": "<self>"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": ""}, None),
        ({"WATCHDOG_USEC": "garbage"}, None),
        ({"WATCHDOG_USEC": "-2000000"}, None),
        ({"WATCHDOG_USEC": "2e6"}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    pids = {"<self>": str(os.getpid()), "<other>": str(os.getpid() + 1)}
    env = {key: pids.get(value, value) for key, value in env.items()}
    assert watchdog_interval(env) == expected


def test_watchdog_interval_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "500000")
    assert watchdog_interval() == 0.25
    monkeypatch.delenv("WATCHDOG_USEC")
    assert watchdog_interval() is None


# --- Watchdog -----------------------------------------------------------------------------------


async def _watch(
    address: str,
    receiver: socket.socket,
    healthy: Callable[[], Awaitable[bool]],
    enough: Callable[[Watchdog], bool],
) -> tuple[Watchdog, list[bytes]]:
    """Run a 0.05 s Watchdog until `enough(watchdog)`, then stop it and collect every datagram it
    sent (its `pings` counts each one the socket took)."""
    receiver.setblocking(False)
    loop = asyncio.get_running_loop()
    received: list[bytes] = []

    async def collect() -> None:
        while True:  # read as they come: an unread unix dgram queue blocks senders at ~10
            received.append(await loop.sock_recv(receiver, 4096))

    watchdog = Watchdog(0.05, healthy, env={"NOTIFY_SOCKET": address})
    run, collecting = asyncio.create_task(watchdog.run()), asyncio.create_task(collect())
    await settle(lambda: enough(watchdog), "the watchdog running its checks")
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    # No more are sent: what was sent is all in the socket, read it to the last one.
    await settle(lambda: len(received) >= watchdog.pings, "every ping sent received")
    collecting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await collecting
    received += _drain(receiver)
    return watchdog, received


def test_watchdog_pings_while_healthy(notify_socket: tuple[str, socket.socket]) -> None:
    async def healthy() -> bool:
        return True

    watchdog, received = asyncio.run(_watch(*notify_socket, healthy, lambda w: w.pings >= 4))
    assert len(received) >= 4
    assert set(received) == {b"WATCHDOG=1"}
    assert watchdog.pings == len(received)
    assert watchdog.skipped == 0


@pytest.mark.parametrize("failure", ["false", "raises", "hangs"])
def test_watchdog_withholds_pings_while_unhealthy(
    notify_socket: tuple[str, socket.socket], failure: str
) -> None:
    async def unhealthy() -> bool:
        if failure == "raises":
            raise RuntimeError("store does not answer")
        if failure == "hangs":
            await asyncio.sleep(3600)  # the health check that never answers
        return False

    watchdog, received = asyncio.run(
        _watch(*notify_socket, unhealthy, lambda w: w.skipped + w.pings >= 3)
    )
    assert received == []
    assert watchdog.pings == 0
    assert watchdog.skipped >= 3  # the loop did run its checks


def test_watchdog_resumes_when_health_returns(notify_socket: tuple[str, socket.socket]) -> None:
    address, receiver = notify_socket
    state = {"healthy": False}

    async def healthy() -> bool:
        return state["healthy"]

    async def scenario() -> tuple[list[bytes], list[bytes], Watchdog]:
        receiver.setblocking(False)
        watchdog = Watchdog(0.05, healthy, env={"NOTIFY_SOCKET": address})
        task = asyncio.create_task(watchdog.run())
        await settle(lambda: watchdog.skipped >= 2, "two failed checks")
        before = _drain(receiver)
        state["healthy"] = True
        await settle(lambda: watchdog.pings >= 2, "two pings after health returned")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return before, _drain(receiver), watchdog

    before, after, watchdog = asyncio.run(scenario())
    assert before == []
    assert len(after) == watchdog.pings >= 2 and set(after) == {b"WATCHDOG=1"}


def _drain(receiver: socket.socket) -> list[bytes]:
    datagrams = []
    while True:
        try:
            datagrams.append(receiver.recv(4096))
        except BlockingIOError:
            return datagrams


@pytest.mark.parametrize("interval", [0, -1.0, float("nan"), float("inf")])
def test_watchdog_rejects_a_bad_interval(interval: float) -> None:
    async def healthy() -> bool:
        return True

    with pytest.raises(ConfigError):
        Watchdog(interval, healthy)


# --- listen_sockets, in-process: the cases that must not touch any fd ---------------------------


@pytest.mark.parametrize(
    "env",
    [
        {},
        {"LISTEN_FDS": "1"},  # LISTEN_PID absent: inherited, not ours (as sd_listen_fds)
        {"LISTEN_FDS": "1", "LISTEN_PID": "<other>", "LISTEN_FDNAMES": "x"},
        {"LISTEN_FDS": "1", "LISTEN_PID": "garbage"},
        {"LISTEN_FDS": "0", "LISTEN_PID": "<self>"},
    ],
)
def test_listen_sockets_when_not_activated(env: dict[str, str]) -> None:
    pids = {"<self>": str(os.getpid()), "<other>": str(os.getpid() + 1)}
    env = {key: pids.get(value, value) for key, value in env.items()} | {"OTHER": "kept"}
    kept = dict(env)
    assert listen_sockets(dict(kept), unset=False) == []
    assert listen_sockets(env) == []
    assert env == {"OTHER": "kept"}  # unset=True removes LISTEN_* even when they were not ours


def test_listen_sockets_rejects_a_garbage_count_and_still_unsets() -> None:
    env = {"LISTEN_FDS": "one", "LISTEN_PID": str(os.getpid()), "LISTEN_FDNAMES": "x"}
    with pytest.raises(ConfigError):
        listen_sockets(env)
    assert env == {}


# --- listen_sockets, activated: a launcher plays systemd ----------------------------------------

# Moves the fds named in argv[1] to 3, 4, ... (via fds >= 100 so no move clobbers another), sets
# the LISTEN_* variables for its own pid and execs Python, which keeps that pid: what systemd does.
LAUNCHER = """
import fcntl, os, sys
sources = [int(fd) for fd in sys.argv[1].split(",")]
high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in sources]
for fd in sources:
    os.close(fd)
for index, fd in enumerate(high):
    os.dup2(fd, 3 + index)
    os.close(fd)
os.environ["LISTEN_FDS"] = str(len(high))
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDNAMES"] = ":".join(f"s{index}" for index in range(len(high)))
os.execv(sys.executable, [sys.executable, "-c", sys.argv[2]])
"""

# Claims the sockets, reports what it got, then echoes one connection on the first socket.
# A grandchild spawned with close_fds=False shows what an exec'd child of the daemon inherits.
ECHO_CHILD = """
import json, os, subprocess, sys
from prefixd.daemon.systemd import listen_sockets
socks = listen_sockets()
probe = (
    "import json, os\\n"
    "def is_open(fd):\\n"
    "    try:\\n"
    "        os.fstat(fd)\\n"
    "        return True\\n"
    "    except OSError:\\n"
    "        return False\\n"
    "print(json.dumps({'env': sorted(k for k in os.environ if k.startswith('LISTEN_')),"
    " 'open': [fd for fd in (3, 4) if is_open(fd)]}))"
)
grandchild = json.loads(
    subprocess.run([sys.executable, "-c", probe], close_fds=False, capture_output=True,
                   text=True, check=True).stdout
)
print(json.dumps({
    "kinds": [[s.family, s.type] for s in socks],
    "fds": [s.fileno() for s in socks],
    "env": sorted(k for k in os.environ if k.startswith("LISTEN_")),
    "inheritable": [os.get_inheritable(s.fileno()) for s in socks],
    "grandchild": grandchild,
}), flush=True)
conn, _ = socks[0].accept()
with conn:
    conn.sendall(b"echo:" + conn.recv(1024))
"""

FILE_CHILD = """
import os
from prefixd.daemon.systemd import listen_sockets
from prefixd.errors import ConfigError
try:
    listen_sockets()
except ConfigError as exc:
    left = sorted(k for k in os.environ if k.startswith("LISTEN_"))
    print("ConfigError", "fd 3" in str(exc), left)
else:
    print("no error")
"""


def _launch(tmp_path: Path, fds: list[int], child: str) -> subprocess.Popen[str]:
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LISTEN_")}
    return subprocess.Popen(
        [sys.executable, str(launcher), ",".join(map(str, fds)), textwrap.dedent(child)],
        pass_fds=fds,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
    )


def test_listen_sockets_in_an_activated_process(short_dir: Path) -> None:
    path = str(short_dir / "prefixd.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    datagram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    with listener, datagram:
        proc = _launch(short_dir, [listener.fileno(), datagram.fileno()], ECHO_CHILD)
    # Only the child holds the listening socket now; the echo proves it accepted on fd 3.
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(20)
            client.connect(path)
            client.sendall(b"ping")
            assert client.recv(1024) == b"echo:ping"
        stdout, stderr = proc.communicate(timeout=20)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, stderr
    report = json.loads(stdout)
    assert report["kinds"] == [
        [socket.AF_UNIX, socket.SOCK_STREAM],
        [socket.AF_UNIX, socket.SOCK_DGRAM],
    ]
    assert report["fds"] == [3, 4]
    assert report["env"] == []  # removed from os.environ ...
    assert report["grandchild"]["env"] == []  # ... and from the real environment children get
    assert report["inheritable"] == [False, False]
    assert report["grandchild"]["open"] == []  # close-on-exec: a child never holds the listener


def test_listen_sockets_rejects_an_fd_that_is_no_socket(tmp_path: Path) -> None:
    with open(tmp_path / "plain-file", "w+") as plain:
        proc = _launch(tmp_path, [plain.fileno()], FILE_CHILD)
    stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0, stderr
    assert stdout.strip() == "ConfigError True []"


# --- the unit files -----------------------------------------------------------------------------


def _verify(directory: Path, *names: str) -> list[str]:
    """Run `systemd-analyze verify` and return its complaints about our units.

    It exits 0 even for unknown keys or unparsable values, so every line it prints about one of
    `names` counts; lines about other units on the host (pulled in as dependencies) do not.
    """
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    result = subprocess.run(
        [analyze, "verify", *names], cwd=directory, capture_output=True, text=True, timeout=60
    )
    mentions = re.compile("|".join(re.escape(name) for name in names))
    output = (result.stdout + result.stderr).splitlines()
    complaints = [line for line in output if mentions.search(line)]
    if result.returncode != 0 and not complaints:
        complaints = [f"exit {result.returncode}: {result.stderr.strip()}"]
    return complaints


def _copy_units(directory: Path) -> None:
    """The shipped units, with ExecStart= pointing at an executable that exists on this machine."""
    for name in UNITS:
        text = (REPO / "systemd" / name).read_text()
        (directory / name).write_text(text.replace("/usr/local/bin/prefixd", sys.executable))


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    _copy_units(tmp_path)
    assert _verify(tmp_path, *UNITS) == []


def test_example_drop_in_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    _copy_units(tmp_path)
    drop_ins = tmp_path / "prefixd.service.d"
    drop_ins.mkdir()
    shutil.copy(REPO / "systemd" / "prefixd.conf.example", drop_ins / "local.conf")
    assert _verify(tmp_path, *UNITS) == []


def test_systemd_analyze_check_catches_unit_errors(tmp_path: Path) -> None:
    """The check above is only worth something if a broken unit makes it fail."""
    _copy_units(tmp_path)
    service = tmp_path / "prefixd.service"
    text = service.read_text()
    broken = text.replace("WatchdogSec=30", "WatchdogSek=30")
    broken = broken.replace("ProtectHome=yes", "ProtectHome=maybe")
    assert broken != text
    service.write_text(broken)
    complaints = _verify(tmp_path, *UNITS)
    assert any("WatchdogSek" in line for line in complaints)
    assert any("maybe" in line for line in complaints)


def test_units_agree_with_each_other() -> None:
    """What the socket listens on is where the daemon's default socket path points."""
    service = (REPO / "systemd" / "prefixd.service").read_text()
    sock = (REPO / "systemd" / "prefixd.socket").read_text()
    assert "ListenStream=/run/prefixd/prefixd.sock" in sock.splitlines()
    assert "RuntimeDirectory=prefixd" in service.splitlines()
    assert "Service=prefixd.service" in sock.splitlines()
    assert "Type=notify" in service.splitlines()
    assert "RuntimeDirectoryPreserve=yes" in service.splitlines()


def test_unit_files_name_only_real_settings() -> None:
    """Every PREFIXD_* variable the unit files mention is one the daemon's Config accepts."""
    config = pytest.importorskip("prefixd.daemon.config")
    known = {config.CONFIG_ENV} | {config.env_var(name) for name in config.SETTINGS}
    mentioned: set[str] = set()
    for name in (*UNITS, "prefixd.conf.example"):
        mentioned |= set(re.findall(r"PREFIXD_[A-Z0-9_]+", (REPO / "systemd" / name).read_text()))
    assert mentioned  # the check is not vacuous
    assert mentioned <= known
