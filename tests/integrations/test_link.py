"""DaemonLink, the engines' connection to the daemon (vLLM, SGLang, LMCache adapters).

A daemon the engine cannot reach, trust or use turns every lookup into a miss; that must never be
silent. Each kind of problem is one ERROR with its fix, then at most one a minute per problem
(with the count held back), timed by an injected clock; `status()` (the adapters' stats) says
what is wrong; no log line carries token ids or keys.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixd.errors import DaemonUnavailableError, RequestTimeoutError
from prefixd.integrations.link import DaemonLink

from ..daemon.conftest import IDENTITY, NOBODY, Daemon, DaemonFactory, as_nobody, payload
from ..waiting import DEADLINE_S

LOGGER = "prefixd.integrations.link"
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as uid 65534")


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def link_to(path: Path, clock: Clock, **options: Any) -> DaemonLink:
    options.setdefault("region_bytes", 1 << 20)
    return DaemonLink(
        str(path), timeout_s=10.0, name="test-link", label="test engine", clock=clock, **options
    )


def logged(caplog: pytest.LogCaptureFixture, level: int = logging.ERROR) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def health(link: DaemonLink) -> Any:
    return link.call(lambda c: c.health())


@pytest.fixture(autouse=True)
def no_daemon_user(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv("PREFIXD_DAEMON_USER", raising=False)
    caplog.set_level(logging.INFO, logger=LOGGER)


def test_an_unreachable_daemon_is_one_error_with_the_fix_then_one_a_minute(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    path = tmp_path / "run" / "prefixd.sock"
    link = link_to(path, clock)
    for _ in range(5):
        assert health(link) is None
        clock.advance(1.0)
    [error] = logged(caplog)
    assert str(path) in error and "every lookup is a miss" in error
    assert "systemctl start prefixd.socket" in error
    status = link.status()
    assert status["connected"] is False
    assert status["unusable_calls"] == 5 and status["failures"]["unreachable"] == 5
    last = status["last_problem"]
    assert (last["kind"], last["error"]) == ("unreachable", "DaemonUnavailableError")
    assert "systemctl start" in last["message"] + last["fix"] and last["age_s"] == 1.0

    clock.advance(55.0)  # 60 s after the first: logged again, with the repeats held back
    assert health(link) is None
    errors = logged(caplog)
    assert len(errors) == 2 and "(4 more times in the last 60 s)" in errors[1]
    clock.advance(30.0)
    assert health(link) is None
    assert len(logged(caplog)) == 2
    assert link.status()["failures"]["unreachable"] == 7


def test_a_socket_of_another_user_is_untrusted_and_its_fix_names_the_setting(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "impostor.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    options: dict[str, Any] = {}
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)  # root trusts root and itself: make it another's
    else:
        options["daemon_uid"] = NOBODY
    clock = Clock()
    link = link_to(path, clock, **options)
    for _ in range(3):
        assert health(link) is None
    [error] = logged(caplog)
    assert "PREFIXD_DAEMON_USER" in error and "not sending anything" in error
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing was even connected
    listener.close()
    status = link.status()
    assert status["failures"]["untrusted"] == 3 and status["unusable_calls"] == 3
    assert status["last_problem"]["error"] == "UntrustedDaemonError"


def test_distinct_problems_are_each_logged_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The rate limit holds back a problem already logged, never a new one."""
    path = tmp_path / "prefixd.sock"
    clock = Clock()
    link = link_to(path, clock, daemon_uid=NOBODY if os.geteuid() else None)
    assert health(link) is None  # no socket
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    assert health(link) is None  # a socket, not the daemon's user's
    listener.close()
    kinds = [link.status()["failures"][k] for k in ("unreachable", "untrusted")]
    assert kinds == [1, 1] and len(logged(caplog)) == 2


def test_back_again_it_says_so_and_keeps_the_last_problem(
    daemon_factory: DaemonFactory, sock_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    path = sock_dir / "later.sock"
    link = link_to(path, clock, reconnect_s=1.0)
    assert health(link) is None
    assert health(link) is None  # within reconnect_s: not even tried
    assert link.status()["failures"]["unreachable"] == 1
    daemon_factory(socket_path=path)
    clock.advance(1.0)
    assert health(link) is not None
    assert any("connected to the daemon" in m and "again" in m for m in logged(caplog, 30))
    status = link.status()
    assert status["connected"] is True and status["unusable_calls"] == 2
    assert status["last_problem"]["kind"] == "unreachable"
    link.close()


def test_a_refused_call_is_an_error_naming_its_class_and_code_never_the_keys(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    link = link_to(daemon.socket, Clock())
    assert link.call(lambda c: c.call({"op": "no_such_op"})) is None
    [error] = logged(caplog)
    assert "UnknownOperationError" in error and "unknown_op" in error
    assert "the call was answered as a miss" in error
    # a put whose parent is not stored: a race with eviction, logged as a warning, without keys
    prompt = np.arange(2 * IDENTITY.block_tokens, dtype=np.uint32) + 987_654_321
    put = link.call(lambda c: c.put(IDENTITY, prompt, [payload(1, 1)], first_block=1))
    assert put is None
    [warning] = logged(caplog, logging.WARNING)
    assert "OrphanBlockError" in warning
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "987654" not in text and prompt.tobytes()[:4].hex() not in text
    status = link.status()
    assert status["connected"] is True and status["unusable_calls"] == 0
    assert status["failures"]["refused"] == 2
    link.close()


def test_a_region_the_daemon_refuses_or_a_transfer_cannot_fit_names_region_bytes(
    daemon_factory: DaemonFactory, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = daemon_factory("--max-region-bytes", "8MiB")
    big = link_to(daemon.socket, Clock(), region_bytes=16 << 20)
    assert health(big) is None
    [error] = logged(caplog)
    assert "region_bytes=16777216" in error and "max_region_bytes" in error
    assert big.status()["failures"]["region"] == 1

    small = link_to(daemon.socket, Clock(), region_bytes=64 << 10)
    prompt = np.arange(IDENTITY.block_tokens, dtype=np.uint32)
    assert small.call(lambda c: c.put(IDENTITY, prompt, [bytes(128 << 10)])) is None
    second = logged(caplog)[1]
    assert "does not fit the shared region" in second
    assert "raise the adapter's region_bytes (now 65536)" in second
    assert small.status()["unusable_calls"] == 1 and small.status()["connected"] is True
    small.close()


def _as_nobody_with_logs(act: Callable[[], DaemonLink]) -> tuple[dict[str, Any], list[str]]:
    """Run `act` as uid 65534 and bring back the link's status and its ERROR lines."""

    def attempt() -> tuple[dict[str, Any], list[str]]:
        lines: list[str] = []

        class Collect(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if record.levelno >= logging.ERROR:
                    lines.append(record.getMessage())

        logging.getLogger(LOGGER).addHandler(Collect())
        link = act()
        return link.status(), lines

    kind, outcome = as_nobody(attempt)
    assert kind == "ok", outcome
    status, lines = outcome
    return status, lines


@root_only
def test_a_user_the_daemon_refuses_is_told_how_to_be_let_in(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    os.chmod(sock_dir, 0o711)  # nobody reaches the socket, and the daemon does not allow it
    daemon = daemon_factory("--socket-mode", "0666")

    def act() -> DaemonLink:
        link = link_to(daemon.socket, Clock())
        for _ in range(3):
            health(link)
        return link

    status, errors = _as_nobody_with_logs(act)
    [error] = errors
    assert "may not use this daemon" in error
    assert "group prefixd" in error and "allowed_uids" in error and "nobody" in error
    assert status["failures"]["forbidden"] == 3 and status["unusable_calls"] == 3
    assert status["last_problem"]["error"] == "ForbiddenError"


@root_only
def test_a_socket_directory_the_user_may_not_enter_names_it_and_the_group(
    daemon: Daemon,
) -> None:
    def act() -> DaemonLink:
        link = link_to(daemon.socket, Clock())
        health(link)
        return link

    status, errors = _as_nobody_with_logs(act)  # sock_dir is 0700 root
    [error] = errors
    assert f"nobody may not enter the directory {daemon.socket.parent}" in error
    assert "usermod -aG" in error
    assert status["failures"]["denied"] == 1


def test_a_lease_taken_before_a_reconnect_is_never_put_through_the_next_connection(
    daemon: Daemon,
) -> None:
    """An adapter takes a lease on one thread and puts it from another (the vLLM spec's worker):
    if the link reconnected meanwhile, the lease's offsets name the new region, where another
    caller's lease may lie. Its bytes must not be stored under this prompt's tokens."""
    link = link_to(daemon.socket, Clock(), reconnect_s=0.0)
    first = link.client()
    assert first is not None
    mine = first.try_reserve(256)
    assert mine is not None
    mine.view[:] = b"A" * 256
    link.failed(first, DaemonUnavailableError("the daemon went away"))  # as a lost call does
    second = link.client()
    assert second is not None and second is not first
    other = second.try_reserve(256)
    assert other is not None and other.offset == mine.offset
    other.view[:] = b"B" * 256
    tokens = np.arange(IDENTITY.block_tokens, dtype=np.uint32) + 5
    spans = [(mine.offset, 256)]
    assert link.call(lambda c: c.put_spans(IDENTITY, tokens, spans, lease=mine)) is None
    found = link.call(lambda c: c.lookup(IDENTITY, [tokens]))
    assert found is not None and found[0].n_blocks == 0  # nothing stored


def test_a_connection_dropped_under_another_threads_call_is_closed_after_it(
    daemon: Daemon,
) -> None:
    """One thread's call times out while another's is under way on the same connection: the
    link drops it, but closing it (and unmapping its region) waits for the other call to end,
    which would otherwise fail with an error no adapter expects."""
    link = link_to(daemon.socket, Clock())
    inside, go_on = threading.Event(), threading.Event()
    got: dict[str, Any] = {}
    tokens = np.arange(IDENTITY.block_tokens, dtype=np.uint32) + 9

    def put(client: Any) -> int:
        inside.set()
        assert go_on.wait(DEADLINE_S)
        lease = client.reserve(256)
        lease.view[:] = b"p" * 256
        stored = client.put_spans(IDENTITY, tokens, [(lease.offset, 256)], lease=lease).stored
        lease.release()
        got["client"] = client
        return int(stored)

    def engine() -> None:
        try:
            got["stored"] = link.call(put)
        except BaseException as exc:  # noqa: BLE001 - what would reach the engine
            got["escaped"] = exc

    thread = threading.Thread(target=engine)
    thread.start()
    assert inside.wait(DEADLINE_S)

    def timed_out(client: Any) -> None:
        raise RequestTimeoutError("no reply within 10 s")

    assert link.call(timed_out) is None  # the link drops the connection
    go_on.set()
    thread.join(DEADLINE_S)
    assert "escaped" not in got and got["stored"] == 1, got
    assert got["client"].region.fd < 0  # closed once its call ended
    link.close()
