"""The systemd protocols without systemd (a fake notify socket, fds handed over by a launcher),
and the unit files: checked by systemd-analyze, and run in the sandbox they describe."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import re
import secrets
import shlex
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.daemon.systemd import Watchdog, listen_sockets, notify, watchdog_interval
from prefixd.errors import ConfigError
from tests.waiting import settle, wait_for

from ..cluster.conftest import mooncake_master  # noqa: F401 (a fixture, used below)
from ..readme import readme_block
from .conftest import (
    DEADLINE_S,
    IDENTITY,
    DaemonFactory,
    as_nobody,
    make_identity,
    payload,
)

REPO = Path(__file__).resolve().parents[2]
UNITS = ("prefixd.service", "prefixd.socket")
TEMPLATES = ("prefixd@.service", "prefixd@.socket")  # several daemons on a node, one per instance
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

# Where the unit expects the install (docs/operating.md, "systemd"): a venv under /opt/prefixd.
EXEC_START = "/opt/prefixd/bin/prefixd"
# The drop-ins shipped beside the unit, by what they open up.
DROP_INS = {
    "metrics-tcp": "prefixd.metrics-tcp.conf",
    "textfile": "prefixd.textfile.conf",
    "cluster": "prefixd.cluster.conf",
}
EXPOSURE = re.compile(r"Overall exposure level for (\S+): (\d+\.\d+)")


def _analyze() -> str:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed (Debian: apt-get install systemd)")
    return analyze


def _verify(directory: Path, *names: str, about: Sequence[str] = ()) -> list[str]:
    """Run `systemd-analyze verify` and return its complaints about our units.

    It exits 0 even for unknown keys or unparsable values, so every line it prints about one of
    `names` (or a drop-in of theirs, or one of the unit files in `about`: the templates an
    instance's name is made from) counts; lines about other units on the host (pulled in as
    dependencies) do not.
    """
    result = subprocess.run(
        [_analyze(), "verify", *names],
        cwd=directory,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    mentions = re.compile("|".join(re.escape(name) for name in (*names, *about)))
    output = (result.stdout + result.stderr).splitlines()
    complaints = [line for line in output if mentions.search(line)]
    if result.returncode != 0 and not complaints:
        complaints = [f"exit {result.returncode}: {result.stderr.strip()}"]
    return complaints


def _copy_units(directory: Path, *drop_ins: str) -> None:
    """The shipped units, with ExecStart= pointing at an executable that exists on this machine
    (verify refuses a missing one), and `drop_ins` in prefixd.service.d/ as an operator installs
    them."""
    for name in (*UNITS, *TEMPLATES):
        text = (REPO / "systemd" / name).read_text()
        (directory / name).write_text(text.replace(EXEC_START, sys.executable))
    if drop_ins:
        (directory / "prefixd.service.d").mkdir()
    for name in drop_ins:  # systemd reads *.conf only
        installed = name if name.endswith(".conf") else "local.conf"
        shutil.copy(REPO / "systemd" / name, directory / "prefixd.service.d" / installed)


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    _copy_units(tmp_path)
    assert _verify(tmp_path, *UNITS) == []


@pytest.mark.parametrize("name", ["prefixd.conf.example", *DROP_INS.values()])
def test_each_drop_in_passes_systemd_analyze_verify(tmp_path: Path, name: str) -> None:
    _copy_units(tmp_path, name)
    assert _verify(tmp_path, *UNITS) == []


def test_systemd_analyze_check_catches_unit_errors(tmp_path: Path) -> None:
    """The checks above are only worth something if a broken unit, or a broken drop-in, makes
    them fail (verify reads prefixd.service.d/ beside the unit)."""
    _copy_units(tmp_path, DROP_INS["metrics-tcp"])
    service = tmp_path / "prefixd.service"
    text = service.read_text()
    broken = text.replace("WatchdogSec=30", "WatchdogSek=30")
    broken = broken.replace("ProtectHome=yes", "ProtectHome=maybe")
    assert broken != text
    service.write_text(broken)
    drop_in = tmp_path / "prefixd.service.d" / DROP_INS["metrics-tcp"]
    drop_in.write_text(drop_in.read_text().replace("ProcSubset=all", "ProcSubset=most"))
    complaints = _verify(tmp_path, *UNITS)
    assert any("WatchdogSek" in line for line in complaints)
    assert any("maybe" in line for line in complaints)
    assert any("most" in line for line in complaints)


def _exposure(unit: Path) -> float:
    """`systemd-analyze security --offline=yes`'s overall exposure of `unit` (0 safe, 10 not)."""
    result = subprocess.run(
        [_analyze(), "security", "--offline=yes", "--no-pager", unit.name],
        cwd=unit.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    found = EXPOSURE.search(result.stdout)
    assert found is not None and found.group(1) == unit.name, result.stdout + result.stderr
    return float(found.group(2))


@pytest.mark.parametrize("drop_in", [None, *DROP_INS])
def test_hardening_at_least_that_of_debians_redis_unit(tmp_path: Path, drop_in: str | None) -> None:
    """Debian's redis-server unit is the bar (1.2 with Debian 12's systemd 252): the unit alone,
    and with each drop-in that opens something up, exposes no more than it."""
    redis = Path("/lib/systemd/system/redis-server.service")
    if not redis.is_file():
        pytest.skip("Debian's redis-server is not installed (apt-get install redis-server)")
    shutil.copy(redis, tmp_path / redis.name)
    _copy_units(tmp_path, *([DROP_INS[drop_in]] if drop_in else []))
    bar = _exposure(tmp_path / redis.name)
    assert _exposure(tmp_path / "prefixd.service") <= bar


def test_template_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    """An instance of the templates, as `systemctl enable --now prefixd@gpu0.socket` makes one."""
    _copy_units(tmp_path)
    assert _verify(tmp_path, "prefixd@gpu0.service", "prefixd@gpu0.socket", about=TEMPLATES) == []
    broken = tmp_path / "prefixd@.service"
    broken.write_text(broken.read_text().replace("WatchdogSec=30", "WatchdogSek=30"))
    complaints = _verify(tmp_path, "prefixd@gpu0.service", about=TEMPLATES)
    assert any("WatchdogSek" in line for line in complaints)  # the check sees the template


def test_an_instance_is_hardened_as_the_unit(tmp_path: Path) -> None:
    _copy_units(tmp_path)
    assert _exposure(tmp_path / "prefixd@gpu0.service") <= _exposure(tmp_path / "prefixd.service")


def _sections(name: str) -> dict[str, list[str]]:
    """A unit file's assignments, comments left out, by section, in order."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for raw in (REPO / "systemd" / name).read_text().splitlines():
        line = raw.strip()
        if line.startswith("["):
            current = sections.setdefault(line, [])
        elif line and not line.startswith(("#", ";")):
            current.append(line)
    return sections


def test_the_templates_are_the_units_with_an_instances_names() -> None:
    """prefixd@.service and prefixd@.socket say what prefixd.service and prefixd.socket say, line
    for line, but for the instance's names: its own store, socket and settings, so no two
    instances share a directory, and a change to the unit cannot miss the template."""
    for unit, template in zip(UNITS, TEMPLATES, strict=True):
        instance = {
            section: [
                line
                for line in lines
                if line != "Environment=PREFIXD_INSTANCE=%i"  # the instance's own default paths
            ]
            for section, lines in _sections(template).items()
        }
        plain = {
            section: [
                line.replace("prefixd.socket", "prefixd@%i.socket")
                .replace("prefixd.service", "prefixd@%i.service")
                .replace("StateDirectory=prefixd", "StateDirectory=prefixd-%i")
                .replace("RuntimeDirectory=prefixd", "RuntimeDirectory=prefixd-%i")
                .replace("/run/prefixd/", "/run/prefixd-%i/")
                .replace("KV-cache store", "KV-cache store, instance %i")
                .replace("prefixd socket", "prefixd socket, instance %i")
                for line in lines
            ]
            for section, lines in _sections(unit).items()
        }
        assert instance == plain, template
    service = _sections("prefixd@.service")["[Service]"]
    assert "Environment=PREFIXD_INSTANCE=%i" in service
    assert {"StateDirectory=prefixd-%i", "RuntimeDirectory=prefixd-%i"} <= set(service)
    listen = "ListenStream=/run/prefixd-%i/prefixd.sock"
    assert listen in _sections("prefixd@.socket")["[Socket]"]


def test_units_agree_with_each_other() -> None:
    """What the socket listens on is where the daemon's default socket path points."""
    service = (REPO / "systemd" / "prefixd.service").read_text()
    sock = (REPO / "systemd" / "prefixd.socket").read_text()
    assert "ListenStream=/run/prefixd/prefixd.sock" in sock.splitlines()
    assert "RuntimeDirectory=prefixd" in service.splitlines()
    assert "Service=prefixd.service" in sock.splitlines()
    assert "Type=notify" in service.splitlines()
    assert "RuntimeDirectoryPreserve=yes" in service.splitlines()


def test_unit_runs_the_install_the_readme_gives() -> None:
    """ExecStart= is the command of the venv the README's systemd install makes (Debian refuses
    pip outside a venv, and ProtectHome=yes hides one under /home), and nothing in the units
    expects another prefix."""
    service = _service_settings("prefixd.service")
    assert service["ExecStart"] == [f"{EXEC_START} serve"]
    venv = EXEC_START.removesuffix("/bin/prefixd")
    quick_start = readme_block("## Quick start: a node", "sh")  # test_quick_start.py runs it
    assert f"python3 -m venv {venv} " in quick_start
    assert f"{venv}/bin/pip install " in quick_start
    assert f"{venv}/share/prefixd/systemd/prefixd.service" in quick_start
    for name in (*UNITS, *TEMPLATES, *DROP_INS.values(), "prefixd.conf.example"):
        text = (REPO / "systemd" / name).read_text()
        assert "/usr/local" not in text and "/usr/bin/prefixd" not in text, name
    assert service["ExecReload"] == ["/bin/kill -HUP $MAINPID"]  # the daemon reloads on SIGHUP
    operating = (REPO / "docs" / "operating.md").read_text()  # "Reloading"
    assert "SIGHUP" in operating and "systemctl reload prefixd" in operating


def test_unit_files_name_only_real_settings() -> None:
    """Every PREFIXD_* variable the unit files mention is one the daemon's Config accepts."""
    config = pytest.importorskip("prefixd.config.settings")
    known = {config.CONFIG_ENV} | {config.env_var(name) for name in config.SETTINGS}
    mentioned: set[str] = set()
    for name in (*UNITS, *TEMPLATES, "prefixd.conf.example", *DROP_INS.values()):
        mentioned |= set(re.findall(r"PREFIXD_[A-Z0-9_]+", (REPO / "systemd" / name).read_text()))
    assert {"PREFIXD_METRICS_PORT", "PREFIXD_METRICS_TEXTFILE"} <= mentioned  # not vacuous
    assert mentioned <= known


def _service_settings(
    *names: str, replace: Mapping[str, str] | None = None
) -> dict[str, list[str]]:
    """The [Service] assignments of the unit files `names`, in the order systemd reads them (the
    unit, then its drop-ins), each key's values in order; `replace` rewrites text first."""
    settings: dict[str, list[str]] = {}
    for name in names:
        text = (REPO / "systemd" / name).read_text()
        for old, new in (replace or {}).items():
            text = text.replace(old, new)
        section = ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith(("#", ";")):
                continue
            if line.startswith("["):
                section = line
            elif section == "[Service]":
                key, _, value = line.partition("=")
                settings.setdefault(key.strip(), []).append(value.strip())
    return settings


# --- the unit's sandbox, without systemd ------------------------------------------------------
#
# CI has no systemd running, but the parts of the unit that could break the daemon are kernel
# features any root process can set up: namespaces (PrivateNetwork=, ProtectSystem=strict with
# its ReadWritePaths=, the /proc of ProtectProc= and ProcSubset=) and seccomp filters
# (SystemCallFilter= with SystemCallErrorNumber=, RestrictAddressFamilies=,
# MemoryDenyWriteExecute=). `Sandbox.of` reads them from the unit and its drop-ins as systemd
# merges them, and SANDBOX applies them the way systemd does (the groups of system calls are
# systemd's own, from `systemd-analyze syscall-filter`) before it execs ExecStart=. Paths are the
# test's: StateDirectory= and RuntimeDirectory= are the daemon's data and socket directories,
# and /tmp is not made private.

SANDBOX = r"""
import ctypes, errno, json, os, re, subprocess, sys

spec = json.loads(sys.argv[1])
if spec["read_only_root"]:  # ProtectSystem=strict: every mount read-only but the listed paths
    for path in spec["read_write"]:  # (and /dev, /proc, /sys: other settings' business)
        subprocess.run(["mount", "--bind", path, path], check=True)
    with open("/proc/self/mountinfo") as mounts:
        points = [line.split()[4] for line in mounts]
    for point in points:
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), point)
        if point not in spec["read_write"] and point.split("/")[1] not in ("dev", "proc", "sys"):
            subprocess.run(["mount", "-o", "remount,bind,ro", point], check=True)
if spec["proc_options"]:  # ProtectProc=, ProcSubset=: a /proc of its own, mounted so
    subprocess.run(["mount", "-t", "proc", "-o", spec["proc_options"], "proc", "/proc"], check=True)


class Cmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]


lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add_array.argtypes = [
    ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(Cmp)]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
lib.seccomp_release.argtypes = [ctypes.c_void_p]
ALLOW = 0x7FFF0000
EQ, GE, MASKED_EQ = 4, 5, 7


def refuse(code):
    return 0x00050000 | code  # SCMP_ACT_ERRNO(code)


def load(default, rules):
    ctx = lib.seccomp_init(default)
    for action, name, cmps in rules:
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            continue  # not a system call of this architecture
        array = (Cmp * len(cmps))(*(Cmp(*c) for c in cmps))
        rc = lib.seccomp_rule_add_array(ctx, action, number, len(cmps), array)
        if rc < 0:
            raise OSError(-rc, f"seccomp_rule_add {name}")
    rc = lib.seccomp_load(ctx)  # sets no_new_privs too (NoNewPrivileges=yes)
    lib.seccomp_release(ctx)
    if rc < 0:
        raise OSError(-rc, "seccomp_load")


if spec["deny_write_execute"]:  # MemoryDenyWriteExecute=yes, as systemd filters it
    wx, x, shm_exec = 0x2 | 0x4, 0x4, 0o100000
    load(ALLOW, [
        (refuse(errno.EPERM), "mmap", [(2, MASKED_EQ, wx, wx)]),
        (refuse(errno.EPERM), "mprotect", [(2, MASKED_EQ, x, x)]),
        (refuse(errno.EPERM), "pkey_mprotect", [(2, MASKED_EQ, x, x)]),
        (refuse(errno.EPERM), "shmat", [(2, MASKED_EQ, shm_exec, shm_exec)]),
    ])
if spec["families"] is not None:  # RestrictAddressFamilies=: socket(2) of other families
    af_max = 64
    load(ALLOW, [
        (refuse(errno.EAFNOSUPPORT), "socket", [(0, EQ, family, 0)])
        for family in range(af_max) if family not in spec["families"]
    ] + [(refuse(errno.EAFNOSUPPORT), "socket", [(0, GE, af_max, 0)])])
if spec["syscalls"] is not None:  # SystemCallFilter= with SystemCallErrorNumber=; the last
    load(refuse(spec["errno"]), [(ALLOW, name, []) for name in spec["syscalls"]])
os.execv(sys.argv[2], sys.argv[2:])
"""


def _syscall_groups() -> dict[str, set[str]]:
    """systemd's groups of system calls (@system-service, ...), each resolved to names."""
    result = subprocess.run(
        [_analyze(), "syscall-filter", "--no-pager"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    members: dict[str, list[str]] = {}
    group = ""
    for raw in result.stdout.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not raw.startswith(" "):
            group = line
            members[group] = []
        else:
            members[group].append(line)

    def resolve(name: str, seen: frozenset[str]) -> set[str]:
        if not name.startswith("@"):
            return {name}
        assert name in members and name not in seen, name
        return set().union(*(resolve(item, seen | {name}) for item in members[name]))

    return {name: resolve(name, frozenset()) for name in members}


@dataclass(frozen=True)
class Sandbox:
    """What the unit (and drop-ins) ask of the kernel, merged as systemd merges them."""

    syscalls: frozenset[str] | None
    error_number: int
    families: frozenset[int] | None
    private_network: bool
    proc_options: str
    deny_write_execute: bool
    read_only_root: bool
    read_write: tuple[str, ...]
    environment: dict[str, str]

    @classmethod
    def of(cls, settings: Mapping[str, list[str]]) -> Sandbox:
        def last(key: str, default: str = "") -> str:
            return settings.get(key, [default])[-1]

        def listed(key: str) -> list[str] | None:
            """A list setting: values add up, an empty one resets (None: never set)."""
            items: list[str] | None = None
            for value in settings.get(key, []):
                items = [] if not value else (items or []) + value.split()
            return items

        syscalls: set[str] | None = None
        if "SystemCallFilter" in settings:
            groups = _syscall_groups()
            for value in settings["SystemCallFilter"]:
                deny = value.startswith("~")
                names = set().union(*(groups.get(n, {n}) for n in value.lstrip("~").split()))
                assert not (deny and syscalls is None), "a deny list first: not what we ship"
                syscalls = (syscalls or set()) - names if deny else (syscalls or set()) | names
        families = listed("RestrictAddressFamilies")
        assert not any(f.startswith("~") for f in families or []), "deny lists: not shipped"
        hidepid = {"invisible": "hidepid=invisible", "noaccess": "hidepid=noaccess"}
        proc_options = [hidepid[last("ProtectProc")]] if last("ProtectProc") in hidepid else []
        if last("ProcSubset") == "pid":
            proc_options.append("subset=pid")
        environment: dict[str, str] = {}
        for value in settings.get("Environment", []):
            for assignment in shlex.split(value):
                key, _, text = assignment.partition("=")
                environment[key] = text
        return cls(
            syscalls=frozenset(syscalls) if syscalls is not None else None,
            error_number=getattr(errno, last("SystemCallErrorNumber", "EPERM")),
            families=(
                frozenset(getattr(socket, name) for name in families)
                if families is not None
                else None
            ),
            private_network=last("PrivateNetwork") == "yes",
            proc_options=",".join(proc_options),
            deny_write_execute=last("MemoryDenyWriteExecute") == "yes",
            read_only_root=last("ProtectSystem") == "strict",
            read_write=tuple(path.lstrip("-") for path in listed("ReadWritePaths") or []),
            environment=environment,
        )

    def launcher(self, exec_start: str, read_write: Sequence[Path]) -> list[str]:
        """The command that runs `exec_start` (ExecStart='s program) in this sandbox, with
        `read_write` (the data and socket directories) writable besides ReadWritePaths=."""
        spec = {
            "read_only_root": self.read_only_root,
            "read_write": [*map(str, read_write), *self.read_write],
            "proc_options": self.proc_options,
            "deny_write_execute": self.deny_write_execute,
            "families": sorted(self.families) if self.families is not None else None,
            "syscalls": sorted(self.syscalls) if self.syscalls is not None else None,
            "errno": self.error_number,
        }
        unshare = ["unshare", "--mount", "--propagation", "private"]
        if self.private_network:
            unshare.append("--net")
        return [*unshare, "--", sys.executable, "-c", SANDBOX, json.dumps(spec), exec_start]


def _in_unit_sandbox(
    state: Path, sock_dir: Path, *drop_ins: str, replace: Mapping[str, str] | None = None
) -> tuple[Sandbox, list[str]]:
    """The sandbox of prefixd.service with `drop_ins` (their text rewritten by `replace`) and the
    launcher that runs its ExecStart= program in it: this venv's `prefixd` command standing in
    for /opt/prefixd's, `state` for StateDirectory=, `sock_dir` for RuntimeDirectory=."""
    for tool in ("unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} not installed (util-linux, mount)")
    if os.geteuid() != 0:
        pytest.skip("namespaces and mounts of the unit's sandbox need root")
    settings = _service_settings("prefixd.service", *drop_ins, replace=replace)
    [command] = settings["ExecStart"]
    program, *args = command.split()
    assert program == EXEC_START and args == ["serve"]
    installed = Path(sys.prefix) / "bin" / "prefixd"
    assert installed.is_file(), f"{installed}: the venv has no prefixd command (pip install -e .)"
    state.mkdir(mode=0o700, exist_ok=True)
    sandbox = Sandbox.of(settings)
    return sandbox, sandbox.launcher(str(installed), [state, sock_dir])


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_the_daemon_serves_under_the_units_sandbox(
    daemon_factory: DaemonFactory, sock_dir: Path, tmp_path: Path
) -> None:
    """Every restriction of the unit at once: the daemon starts, serves puts, lookups, loads,
    stats, health and verify requests, and stops cleanly."""
    sandbox, launcher = _in_unit_sandbox(tmp_path / "state", sock_dir)
    # What the unit asks for, so that the run below is under all of it.
    assert sandbox.syscalls is not None and {"read", "io_uring_setup"} <= sandbox.syscalls
    assert not {"mount", "setuid", "chown", "reboot", "mbind"} & sandbox.syscalls
    assert sandbox.error_number == errno.EPERM
    assert sandbox.families == frozenset({int(socket.AF_UNIX)}) and sandbox.private_network
    assert sandbox.proc_options == "hidepid=invisible,subset=pid"
    assert sandbox.deny_write_execute and sandbox.read_only_root and sandbox.read_write == ()

    daemon = daemon_factory(launcher=launcher, data_dir=tmp_path / "state", env=sandbox.environment)
    status = Path(f"/proc/{daemon.pid}/status").read_text()
    assert re.search(r"^Seccomp:\s+2$", status, re.MULTILINE)  # filtered
    assert re.search(r"^NoNewPrivs:\s+1$", status, re.MULTILINE)
    assert os.readlink(f"/proc/{daemon.pid}/ns/net") != os.readlink("/proc/self/ns/net")
    tokens = np.arange(10 * IDENTITY.block_tokens, dtype=np.uint32) + 500_000_000
    # Small payloads and large ones (read with preadv straight from the data file).
    payloads = [payload(7, index, 256 if index % 2 else 96 << 10) for index in range(10)]
    with Client(daemon.socket, region_bytes=2 << 20) as client:
        assert client.put(IDENTITY, tokens, payloads).stored == 10
        assert client.lookup(IDENTITY, [tokens])[0].n_blocks == 10
        assert [bytes(view) for view in client.load(IDENTITY, tokens).views] == payloads
        assert client.stats()["store"]
        assert client.health()["status"] == "ok"
        report = client.verify()  # on the daemon's admin thread
        assert report["problems"] == [], report
    assert daemon.stop() == 0, daemon.log()


def test_metrics_over_tcp_need_the_metrics_tcp_drop_in(
    daemon_factory: DaemonFactory, sock_dir: Path, tmp_path: Path
) -> None:
    """The unit alone refuses the metrics port (exit 1, naming it); with the drop-in the port
    answers on the host's loopback, process metrics included."""
    port = _free_port()
    unit, bare = _in_unit_sandbox(tmp_path / "bare", sock_dir)
    refused = daemon_factory(
        "--metrics-port", str(port), launcher=bare, data_dir=tmp_path / "bare", wait=False,
        env=unit.environment,
    )  # fmt: skip
    assert refused.proc is not None and refused.proc.wait(DEADLINE_S) == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}" in refused.log()
    assert "Address family not supported" in refused.log()

    sandbox, launcher = _in_unit_sandbox(
        tmp_path / "state", sock_dir, DROP_INS["metrics-tcp"], replace={"9464": str(port)}
    )
    assert sandbox.environment == unit.environment | {"PREFIXD_METRICS_PORT": str(port)}
    daemon_factory(launcher=launcher, data_dir=tmp_path / "state", env=sandbox.environment)
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=DEADLINE_S) as response:
        body = response.read().decode()
    assert "prefixd_build_info" in body
    assert "process_resident_memory_bytes" in body  # the collector could read /proc/stat


def test_the_textfile_drop_in_writes_a_file_only_node_exporter_reads(
    daemon_factory: DaemonFactory, sock_dir: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The drop-in's directory setup, done as its comment says (a stand-in gid for group
    prometheus): the file lands there, read-only elsewhere under ProtectSystem=strict, and is
    readable through the collector's link by that group and by no other user."""
    prometheus_gid = 4321  # no such group needs to exist
    shared = Path(tempfile.mkdtemp(prefix="pdm", dir="/tmp"))  # tmp_path's parents are 0700
    request.addfinalizer(lambda: shutil.rmtree(shared, ignore_errors=True))
    shared.chmod(0o755)  # the collector's user reaches both directories
    metrics_dir = shared / "prefixd-metrics"
    metrics_dir.mkdir()
    os.chown(metrics_dir, os.geteuid(), prometheus_gid)
    metrics_dir.chmod(0o2750)  # install -d -o prefixd -g prometheus -m 2750
    collector_dir = shared / "node-exporter"
    collector_dir.mkdir(mode=0o755)
    (collector_dir / "prefixd.prom").symlink_to(metrics_dir / "prefixd.prom")

    sandbox, launcher = _in_unit_sandbox(
        tmp_path / "state", sock_dir, DROP_INS["textfile"],
        replace={"/var/lib/prefixd-metrics": str(metrics_dir)},
    )  # fmt: skip
    assert sandbox.read_write == (str(metrics_dir),)
    daemon = daemon_factory(launcher=launcher, data_dir=tmp_path / "state", env=sandbox.environment)
    written = metrics_dir / "prefixd.prom"
    wait_for(written.exists, "the metrics textfile written")
    info = written.stat()
    assert (info.st_gid, stat.S_IMODE(info.st_mode)) == (prometheus_gid, 0o640), oct(info.st_mode)
    link = collector_dir / "prefixd.prom"
    assert as_nobody(lambda: "prefixd_build_info" in link.read_text(), [prometheus_gid]) == (
        "ok",
        True,
    )
    outcome, error = as_nobody(link.read_text)
    assert outcome == "error" and error.startswith("PermissionError"), error
    assert daemon.stop() == 0, daemon.log()

    # Without the drop-in's ReadWritePaths= the file cannot be written (and the daemon says so).
    unit, read_only = _in_unit_sandbox(tmp_path / "other", sock_dir)
    assert metrics_dir not in map(Path, unit.read_write)
    refused = daemon_factory(
        launcher=read_only, data_dir=tmp_path / "other", env=sandbox.environment, name="ro"
    )
    wait_for(lambda: "Read-only file system" in refused.log(), "the write refused and logged")
    assert "writing the metrics textfile failed" in refused.log()


# What each restriction does to a process in the sandbox; each line prints the outcome.
PROBE = """
import errno, mmap, os, socket, sys
def outcome(action):
    try:
        action()
    except OSError as exc:
        return errno.errorcode[exc.errno]
    return "ok"
print(outcome(lambda: os.sched_setaffinity(0, os.sched_getaffinity(0))))
print(outcome(lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()))
print(outcome(lambda: socket.socket(socket.AF_UNIX, socket.SOCK_STREAM).close()))
print(outcome(lambda: mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)))
print(outcome(lambda: open("/proc/stat").close()))
print(outcome(lambda: open(f"/proc/{os.getpid()}/stat").close()))
print(outcome(lambda: open(os.path.join(sys.argv[1], "written"), "w").close()))
print(outcome(lambda: open(os.path.join(sys.argv[2], "written"), "w").close()))
"""


def test_the_sandbox_applies_what_the_unit_asks(sock_dir: Path, tmp_path: Path) -> None:
    """The tests above are only worth something if the sandbox really holds the daemon to the
    unit: a probe in it is refused what the unit refuses, and allowed the rest."""
    _, launcher = _in_unit_sandbox(tmp_path / "state", sock_dir)
    elsewhere = Path(tempfile.mkdtemp(prefix="pdw", dir="/tmp"))
    try:
        probe = tmp_path / "probe.py"
        probe.write_text(PROBE)
        # The launcher's program, a Python here, runs the probe instead of `prefixd serve`.
        command = [*launcher[:-1], sys.executable, str(probe), str(tmp_path / "state")]
        command.append(str(elsewhere))
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=DEADLINE_S, check=False
        )
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "EPERM",  # SystemCallFilter=~@resources, SystemCallErrorNumber=EPERM
        "EAFNOSUPPORT",  # RestrictAddressFamilies=AF_UNIX
        "ok",
        "EPERM",  # MemoryDenyWriteExecute=yes
        "ENOENT",  # ProcSubset=pid
        "ok",
        "ok",  # StateDirectory=
        "EROFS",  # ProtectSystem=strict
    ]


class MooncakeMaster(Protocol):
    """What the test uses of tests/cluster's master on loopback."""

    @property
    def master(self) -> str: ...

    @property
    def metadata(self) -> str: ...


def test_the_shared_tier_needs_the_cluster_drop_in(
    daemon_factory: DaemonFactory,
    sock_dir: Path,
    tmp_path: Path,
    mooncake_master: MooncakeMaster,
) -> None:
    """With the drop-in (its placeholders made this machine's master and loopback) the daemon
    publishes to the tier under the unit's sandbox; the unit alone serves from the local store
    and counts the tier's errors."""
    replace = {
        "mooncake-master.example:50051": mooncake_master.master,
        "http://mooncake-master.example:8080/metadata": mooncake_master.metadata,
        "10.0.0.11": "127.0.0.1",
        "10.0.0.0/24": "127.0.0.0/8",
    }
    flags = ("--cluster-segment-bytes", "32MiB", "--cluster-timeout-s", "2")
    sandbox, launcher = _in_unit_sandbox(
        tmp_path / "state", sock_dir, DROP_INS["cluster"], replace=replace
    )
    assert sandbox.environment["PREFIXD_CLUSTER_MASTER"] == mooncake_master.master
    assert {socket.AF_INET, socket.AF_INET6} <= (sandbox.families or set())
    unit, bare = _in_unit_sandbox(tmp_path / "bare", sock_dir)
    tier_settings = {k: v for k, v in sandbox.environment.items() if "CLUSTER" in k}
    for name, dropped_in in (("with", True), ("alone", False)):
        daemon = daemon_factory(
            *flags,
            launcher=launcher if dropped_in else bare,
            data_dir=tmp_path / ("state" if dropped_in else "bare"),
            env=sandbox.environment if dropped_in else unit.environment | tier_settings,
            name=name,
        )
        identity = make_identity(tenant=f"systemd-{name}", block_tokens=16)
        tokens = np.arange(16 * 4, dtype=np.uint32) + 900_000_000
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            stored = client.put(identity, tokens, [payload(9, i, 4096) for i in range(4)])
            assert stored.stored == 4

            def tier() -> dict[str, int]:
                counts: dict[str, int] = client.stats()["metrics"]["cluster"]
                return counts

            if dropped_in:
                wait_for(lambda: tier().get("published_blocks", 0) >= 4, "4 blocks published")
            else:
                wait_for(lambda: tier().get("publish_errors", 0) >= 1, "a publish error")
                assert tier().get("published_blocks", 0) == 0
                assert client.lookup(identity, [tokens])[0].n_blocks == 4  # served locally
        assert daemon.stop() == 0, daemon.log()
