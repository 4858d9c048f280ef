"""The real daemon as a subprocess, a fake $NOTIFY_SOCKET, and a raw protocol speaker.

`daemon_factory(*flags, env=...)` starts `python -m prefixd serve` with a datagram socket of ours
as NOTIFY_SOCKET and returns once READY=1 arrived; the daemon's stderr goes to a file (`.log()`).
Teardown sends SIGTERM and waits, SIGKILL being the last resort. Socket paths live in a short
/tmp directory: tmp_path can be too long for an AF_UNIX address (107 bytes).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Self

import msgpack
import numpy as np
import pytest

import prefixd
from prefixd.wire.frames import HEADER, PROTOCOL_VERSION, encode_frame
from prefixd.wire.region import send_with_fds
from tests.hermetic import SYSTEMD_HANDOFF
from tests.waiting import DEADLINE_S as DEADLINE_S  # noqa: PLC0414
from tests.waiting import wait_for as wait_for  # noqa: PLC0414

from ..must_check import assert_data_dir_checks, checks_on_teardown

REPO = Path(__file__).resolve().parents[2]
# Failure bounds, not expectations: a test waits for an event (READY=1, an exit, a condition) and
# fails only if it never comes. They are generous so that an oversubscribed machine (a CI runner,
# a laptop building something) is slow without failing.
READY_TIMEOUT_S = DEADLINE_S
STOP_TIMEOUT_S = DEADLINE_S
NEUTRAL_PREFILL_TOKENS_PER_S = 1.0  # tokens/s: every hit pays to load (Daemon.benefit_neutral)
# Variables of the test runner's environment that must not reach a daemon under test (the suite
# has its own STATE_DIRECTORY and RUNTIME_DIRECTORY: see `command_env`).
_SCRUBBED = SYSTEMD_HANDOFF


def make_identity(**changes: Any) -> prefixd.Identity:
    fields = {
        "model": "m",
        "weights": "w",
        "tokenizer": "t",
        "template": "c",
        "rope": "r",
        "kv_layout": "bf16",
        "block_tokens": 4,
        "tenant": "a",
    }
    fields.update(changes)
    return prefixd.Identity(**fields)


IDENTITY = make_identity()
IDENTITY_DICT = IDENTITY.to_dict()


def payload(seed: int, index: int, size: int = 256) -> bytes:
    """A deterministic payload for block `index` of the prompt `seed`."""
    rng = np.random.default_rng([seed, index])
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def daemon_env(**extra: str) -> dict[str, str]:
    """The environment of a prefixd process under test: no PREFIXD_* setting and nothing systemd
    hands a service, so root's defaults are the FHS paths (tests/daemon/test_node.py gives them
    to a node of its own): whoever relies on a default uses `command_env`."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_") and k not in _SCRUBBED
    }
    env.update(extra)
    return env


def command_env(**extra: str) -> dict[str, str]:
    """The environment of a command that may fall back on the default store or socket (a
    command told only one of them finds the other from the defaults): `daemon_env`'s, with the
    test's own defaults (tests/conftest.py): systemd's variables, the only ones root's defaults
    follow, as a unit's ExecStart= has them."""
    own = {name: os.environ[name] for name in ("STATE_DIRECTORY", "RUNTIME_DIRECTORY")}
    return daemon_env(**{**own, **extra})


class Daemon:
    """One daemon process (and its restarts) on one data dir and one socket path."""

    def __init__(
        self,
        workdir: Path,
        sockdir: Path,
        flags: Sequence[str],
        env: dict[str, str] | None,
        name: str,
        launcher: Sequence[str] | None = None,
        pass_fds: Sequence[int] = (),
    ) -> None:
        self.workdir = workdir
        self.sockdir = sockdir
        self.name = name
        self.data_dir = workdir / f"{name}-data"
        self.socket = sockdir / f"{name}.sock"
        self.flags = list(flags)
        self.extra_env = dict(env or {})
        # What runs `serve ...`: python -m prefixd, or a launcher that execs it (socket activation)
        self.launcher = list(launcher or [sys.executable, "-m", "prefixd"])
        self.pass_fds = tuple(pass_fds)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify_path = sockdir / f"{name}.notify"
        self.notify.bind(str(self.notify_path))
        self.messages: list[bytes] = []  # every datagram received, in order
        self.proc: subprocess.Popen[bytes] | None = None
        self._terminated: subprocess.Popen[bytes] | None = None  # the process sent SIGTERM
        self.logs: list[Path] = []
        self.exit_codes: list[int] = []

    # --- starting and stopping ------------------------------------------------------------------

    def command(self) -> list[str]:
        return [
            *self.launcher,
            "serve",
            "--data-dir",
            str(self.data_dir),
            "--socket",
            str(self.socket),
            "--map-size",
            "256MiB",
            *self.benefit_neutral(),
            *self.flags,
        ]

    def benefit_neutral(self) -> list[str]:
        """A prefill so slow that every hit pays to load, unless the test sets its own: the
        benefit rule (tests/daemon/test_benefit.py) must not turn a test's small hits into
        misses whenever a busy machine makes the daemon's loads slow."""
        if any(flag.startswith("--prefill-tokens-per-s") for flag in self.flags):
            return []
        return ["--prefill-tokens-per-s", str(NEUTRAL_PREFILL_TOKENS_PER_S)]

    def env(self) -> dict[str, str]:
        return daemon_env(NOTIFY_SOCKET=str(self.notify_path), **self.extra_env)

    def start(self, *, wait: bool = True) -> Daemon:
        assert self.proc is None or self.proc.poll() is not None, "already running"
        log_path = self.workdir / f"{self.name}-{len(self.logs)}.stderr"
        self.logs.append(log_path)
        self._mark = len(self.messages)
        with open(log_path, "wb") as stderr:
            self.proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env=self.env(),
                cwd=REPO,
                pass_fds=self.pass_fds,
            )
        if wait:
            self.wait_notify(b"READY=1")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Send `sig` and return the exit code (SIGKILL after `timeout`: then a test fails)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(
                f"daemon ignored signal {sig} for {timeout} s:\n{self.log()}"
            ) from None
        self.exit_codes.append(code)
        return code

    def reload(self) -> bytes:
        """SIGHUP, then the READY=1 that ends the reload (after its RELOADING=1)."""
        self.receive(0.0)
        self._mark = len(self.messages)
        os.kill(self.pid, signal.SIGHUP)
        self.wait_notify(b"RELOADING=1")
        self._mark = next(
            i for i in range(self._mark, len(self.messages)) if b"RELOADING=1" in self.messages[i]
        )
        return self.wait_notify(b"READY=1")

    def restart(self) -> Daemon:
        code = self.stop()
        assert code == 0, self.log()
        return self.start()

    def check_store(self) -> None:
        """Once stopped: the store it served checks clean (tests/must_check.py), unless it is
        gone (a test's own disk, unmounted)."""
        served = any(b"READY=1" in m.split(b"\n") for m in self.messages)
        if served and (self.data_dir / "data.mdb").exists():
            assert_data_dir_checks(self.data_dir)

    def terminate(self) -> None:
        """SIGTERM, once: the graceful stop `close` waits for (a second one would force it)."""
        if self.proc is not None and self.proc.poll() is None and self._terminated is not self.proc:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = self.proc

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.notify.close()

    # --- what it told us ------------------------------------------------------------------------

    def wait_notify(self, needle: bytes, timeout: float = READY_TIMEOUT_S) -> bytes:
        """The first datagram since the last start that contains `needle` (waits for it)."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.messages[self._mark :]:
                if needle in message.split(b"\n"):
                    return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"no {needle!r} from the daemon within {timeout} s; got {self.messages}; "
                    f"exit code {self.proc.poll() if self.proc else None}\n{self.log()}"
                )
            if self.proc is not None and self.proc.poll() is not None:
                self.receive(0.0)
                if any(needle in m.split(b"\n") for m in self.messages[self._mark :]):
                    continue
                raise AssertionError(
                    f"daemon exited with {self.proc.returncode} before sending {needle!r}:\n"
                    f"{self.log()}"
                )
            self.receive(min(left, 0.1))

    def receive(self, timeout: float) -> None:
        if timeout > 0:
            self.notify.settimeout(timeout)
            with contextlib.suppress(TimeoutError, socket.timeout):
                self.messages.append(self.notify.recv(65536))
        self.notify.setblocking(False)
        while True:
            try:
                self.messages.append(self.notify.recv(65536))
            except BlockingIOError:
                break

    def since_start(self) -> list[bytes]:
        self.receive(0.0)
        return self.messages[self._mark :]

    def log(self) -> str:
        return "".join(
            f"--- {path.name}\n{path.read_text(errors='replace')}"
            for path in self.logs
            if path.exists()
        )

    def open_fds(self) -> list[str]:
        """What the daemon's descriptors point at (we are root or the daemon's uid)."""
        fd_dir = Path(f"/proc/{self.pid}/fd")
        out = []
        for entry in fd_dir.iterdir():
            with contextlib.suppress(FileNotFoundError):
                out.append(os.readlink(entry))
        return sorted(out)


# --- a second user ----------------------------------------------------------------------------

NOBODY = 65534  # the second user of the attack tests (they need root to become it)


def as_nobody(action: Callable[[], Any], groups: Sequence[int] = ()) -> tuple[str, Any]:
    """Run `action` in a forked child that is uid and gid 65534 (with `groups` as supplementary
    groups; everything it needs is imported already): ("ok", its result) or
    ("error", "ClassName: message")."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, act, report, exit without running any cleanup
        os.close(read)

        def act() -> Any:
            _become_nobody(groups)
            return action()

        outcome = _outcome(act)
        with os.fdopen(write, "wb") as out:
            pickle.dump(outcome, out)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    result: tuple[str, Any] = pickle.loads(data)
    return result


def _become_nobody(groups: Sequence[int]) -> None:
    os.setgroups(list(groups))
    os.setresgid(NOBODY, NOBODY, NOBODY)
    os.setresuid(NOBODY, NOBODY, NOBODY)


def _outcome(action: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return ("ok", action())
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the test
        return ("error", f"{type(exc).__name__}: {exc}")


@contextlib.contextmanager
def held_as_nobody(
    path: Path, actions: dict[str, Callable[[Any], Any]], groups: Sequence[int] = ()
) -> Iterator[Callable[[str], tuple[str, Any]]]:
    """One client connected as uid 65534 (with `groups`) in a forked child that holds it open: the
    function given runs the named action on that client (the same connection every time, across a
    reload) and returns as_nobody's outcome; the child exits when the block ends."""
    from prefixd.client import Client

    to_child, from_child = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(to_child[1])
        os.close(from_child[0])
        with os.fdopen(to_child[0], "rb") as inp, os.fdopen(from_child[1], "wb") as out:
            client: list[Client] = []

            def connect() -> None:
                _become_nobody(groups)
                client.append(Client(path, region_bytes=1 << 20))

            pickle.dump(_outcome(connect), out)
            out.flush()
            while client:
                try:
                    name = pickle.load(inp)
                except EOFError:
                    break
                pickle.dump(_outcome(functools.partial(actions[name], client[0])), out)
                out.flush()
        os._exit(0)
    os.close(to_child[0])
    os.close(from_child[1])
    with os.fdopen(to_child[1], "wb") as out, os.fdopen(from_child[0], "rb") as inp:

        def run(name: str) -> tuple[str, Any]:
            pickle.dump(name, out)
            out.flush()
            result: tuple[str, Any] = pickle.load(inp)
            return result

        try:
            opened = pickle.load(inp)
            assert opened[0] == "ok", opened
            yield run
        finally:
            out.close()
            os.waitpid(pid, 0)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="pd", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


DaemonFactory = Callable[..., Daemon]


@contextlib.contextmanager
def _factory(workdir: Path, sockdir: Path, check_stores: bool = True) -> Iterator[DaemonFactory]:
    daemons: list[Daemon] = []

    def start(
        *flags: str,
        env: dict[str, str] | None = None,
        wait: bool = True,
        name: str | None = None,
        launcher: Sequence[str] | None = None,
        pass_fds: Sequence[int] = (),
        socket_path: Path | None = None,
        data_dir: Path | None = None,
    ) -> Daemon:
        daemon = Daemon(
            workdir, sockdir, flags, env, name or f"d{len(daemons)}", launcher, pass_fds
        )
        if socket_path is not None:
            daemon.socket = socket_path
        if data_dir is not None:
            daemon.data_dir = data_dir
        daemons.append(daemon)
        return daemon.start(wait=wait)

    try:
        yield start
    finally:
        for daemon in daemons:  # side by side: each may take seconds to close its shared tier
            daemon.terminate()
        for daemon in daemons:
            daemon.close()
    for daemon in daemons if check_stores else ():
        daemon.check_store()


@pytest.fixture
def daemon_factory(
    tmp_path: Path, sock_dir: Path, request: pytest.FixtureRequest
) -> Iterator[DaemonFactory]:
    with _factory(tmp_path, sock_dir, checks_on_teardown(request)) as start:
        yield start


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> Daemon:
    return daemon_factory()


@pytest.fixture(scope="module")
def module_daemon_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonFactory]:
    """Daemons shared by the tests of one module (each test still checks the daemon is fine)."""
    sockdir = Path(tempfile.mkdtemp(prefix="pd", dir="/tmp"))
    try:
        with _factory(tmp_path_factory.mktemp("daemons"), sockdir) as start:
            yield start
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


# --- speaking the protocol by hand ------------------------------------------------------------


class Raw:
    """A raw connection: frames are built and read by hand, nothing is checked for us."""

    def __init__(self, path: Path | str, timeout: float = 10.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(os.fspath(path))
        self._next = 1000

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send_body(self, body: bytes) -> None:
        self.sock.sendall(HEADER.pack(len(body)) + body)

    def send(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        frame = encode_frame(message)
        if fds:
            send_with_fds(self.sock, frame, fds)
        else:
            self.sock.sendall(frame)

    def recv_exact(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            got = self.sock.recv(left)
            if not got:
                raise ConnectionError(f"closed after {n - left} of {n} bytes")
            chunks.append(got)
            left -= len(got)
        return b"".join(chunks)

    def recv(self) -> dict[str, Any]:
        (length,) = HEADER.unpack(self.recv_exact(HEADER.size))
        reply = msgpack.unpackb(self.recv_exact(length), raw=False)
        assert isinstance(reply, dict), reply
        return reply

    def closed_by_peer(self, timeout: float = 5.0) -> bool:
        """Whether the daemon closes this connection (EOF, or a reset) within `timeout`."""
        self.sock.settimeout(timeout)
        try:
            while True:
                if not self.sock.recv(65536):
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    def request(self, op: str, fds: Sequence[int] = (), **fields: Any) -> dict[str, Any]:
        """Send one request with a fresh id and return its reply (which must carry that id)."""
        self._next += 1
        rid = self._next
        self.send({"id": rid, "op": op, **fields}, fds)
        reply = self.recv()
        assert reply.get("id") == rid, reply
        return reply

    def hello(self) -> dict[str, Any]:
        reply = self.request("hello", protocol=PROTOCOL_VERSION, client="raw")
        assert reply["ok"] is True, reply
        return reply


def error_of(reply: dict[str, Any]) -> tuple[str, str]:
    assert reply.get("ok") is False, reply
    return reply["error"]["code"], reply["error"]["message"]


# --- the whole suite's daemon logs ----------------------------------------------------------------

# A run of 8 or more integers (a token id sequence) or 32 or more hex digits (a raw cache key).
_TOKEN_RUN = re.compile(r"(?:\b\d+\b[,;\s]+){7,}\b\d+\b")
_HEX_KEY = re.compile(r"\b[0-9a-fA-F]{32,}\b")


@pytest.fixture(scope="session", autouse=True)
def daemon_logs_hold_no_prompts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """After the whole session: no daemon log of any test holds token ids or cache keys."""
    yield
    base = tmp_path_factory.getbasetemp()
    logs = sorted(base.rglob("*.stderr"))
    offending = []
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            if _TOKEN_RUN.search(line) or _HEX_KEY.search(line):
                offending.append(f"{log.name}: {line[:200]}")
    assert not offending, "daemon logs hold token ids or keys:\n" + "\n".join(offending[:20])
