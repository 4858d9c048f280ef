"""The shared tier's client in a child process (prefixd.cluster.child), against a tier in a dict
that misbehaves on demand (tests/cluster/fake_tier.py): calls and errors cross the socket, bulk
bytes go through shared memory, and a child stuck with its GIL held costs the daemon's process
nothing but the call's bound."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixd.cluster.child import ChildTier
from prefixd.cluster.mooncake_calls import tag
from prefixd.errors import (
    TierError,
    TierFullError,
    TierTransferError,
    TierUnavailableError,
    TierValueError,
)
from tests.waiting import wait_for

from .fake_tier import HOLD, HOLD_GIL, LOGGED, RELEASE

FAKE = "tests.cluster.fake_tier:open_fake_tier"
CALL_S = 1.5
SLACK_S = 3.0  # a busy 2-core machine: the kill and the next child's start


def make(**settings: object) -> ChildTier:
    """A tier whose child serves already, as the daemon's bridge starts it with the daemon: the
    child's start (an interpreter's, slow on a busy machine) is in no call's bound."""
    tier = ChildTier(settings, factory=FAKE, call_timeout_s=CALL_S, cooldown_s=0.2, workers=2)
    tier.start()
    wait_for(lambda: _answers(tier), "the child serving")
    return tier


@pytest.fixture
def tier() -> Iterator[ChildTier]:
    with make() as child:
        yield child


def test_calls_and_errors_cross_the_socket(tier: ChildTier) -> None:
    tier.put("a", b"alpha")
    tier.put("a", b"other")  # kept: a put without overwrite keeps the first value
    tier.put("b", memoryview(bytearray(b"beta" * 1000)))
    assert tier.size("a") == 5 and tier.size("none") is None
    assert tier.get("a") == b"alpha" and tier.get("none") is None
    tier.put("a", b"ALPHA", overwrite=True)
    room = tier.buffer(2 * 5000)
    assert tier.get_many_into(["a", "none", "b"][:2], room, 5000) == [5, None]
    assert bytes(room[:5]) == b"ALPHA"
    assert tier.get_many_into(["b"], room, 100) == [-1]  # longer than its room
    tier.release(room)
    plain = bytearray(4000)  # not one of the tier's buffers: copied through one
    assert tier.get_into("b", plain) == 4000 and plain == b"beta" * 1000
    with pytest.raises(TierError, match="ChildTier.buffer"):
        tier.get_many_into(["a"], memoryview(bytearray(10)), 10)
    assert tier.exists("a") and tier.exists_many(["a", "x"]) == [True, False]
    with pytest.raises(TierValueError, match="the key is bad") as raised:
        tier.put("bad", b"x")
    assert raised.value.code == -600  # Mooncake's code survives the socket
    with pytest.raises(TierFullError, match="no room"):  # a retry may succeed: its own class
        tier.put("full", b"x")
    with pytest.raises(TierTransferError, match="transfer failed"):  # a dead segment: its own
        tier.put("lost", b"x")
    assert tier.remove("a") and not tier.remove("a")
    assert tier.remove_prefix("b") == 1
    assert tier.restarts == 0


def test_a_child_stuck_with_its_gil_costs_only_the_calls_bound(tier: ChildTier) -> None:
    """A call that holds the child's GIL for good (as Mooncake's setup can): the call fails in
    its bound, the daemon's threads run all along, the child is killed and another serves the
    calls after the cooldown."""
    tier.put("kept", b"v")
    first = tier.pid
    failed: list[BaseException] = []

    def stuck_call() -> None:
        try:
            tier.put(HOLD_GIL, b"x")
        except BaseException as exc:  # noqa: BLE001 - looked at below
            failed.append(exc)

    caller = threading.Thread(target=stuck_call)
    started = time.monotonic()
    caller.start()
    ticks = 0
    while caller.is_alive():  # this thread runs Python all along: the GIL is not held here
        ticks += 1
    took = time.monotonic() - started
    assert len(failed) == 1 and isinstance(failed[0], TierUnavailableError), failed
    assert "no answer" in str(failed[0])
    assert CALL_S <= took < CALL_S + SLACK_S
    assert ticks > 10_000
    assert tier.restarts == 1 and tier.pid != first
    wait_for(lambda: _gone(first), "the stuck child killed")
    with pytest.raises(TierUnavailableError):
        tier.size("kept")  # cooling down, or the next child not started yet: at once
    wait_for(lambda: _answers(tier), "the next child serving")
    assert tier.get("kept") is None  # a new child: what the old one's segment held is gone


def test_calls_overlap_and_one_slow_call_holds_no_other(tier: ChildTier) -> None:
    tier.put("k", b"v")
    slow = threading.Thread(target=tier.put, args=(HOLD, b"x"))
    slow.start()
    wait_for(lambda: tier.in_flight >= 1, "the slow call in flight")
    assert tier.size("k") == 1  # answered while the other waits in the child
    assert slow.is_alive()
    tier.put(RELEASE, b"x")
    slow.join()
    assert tier.restarts == 0


def test_closing_a_child_whose_close_hangs_is_bounded() -> None:
    tier = make(close_holds_gil=True)
    tier.put("k", b"v")
    pid = tier.pid
    started = time.monotonic()
    tier.close()
    assert time.monotonic() - started < 2 * CALL_S + SLACK_S
    assert pid is not None and _gone(pid)
    with pytest.raises(TierError, match="closed"):
        tier.size("k")


def test_the_child_ends_with_its_parent(tmp_path: Path) -> None:
    """A daemon killed with SIGKILL leaves no tier process behind."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import signal; from prefixd.cluster.child import ChildTier;"
                f"t = ChildTier({{'pid_file': {str(pid_file)!r}}}, factory={FAKE!r},"
                " call_timeout_s=5); t.put('k', b'v'); print('up', flush=True); signal.pause()"
            ),
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"up\n"
        child = int(pid_file.read_text())
        assert not _gone(child)
    finally:
        parent.kill()
        parent.wait()
    wait_for(lambda: _gone(child), "the tier process gone with its parent")


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].startswith("Z")  # a zombie has ended
    except FileNotFoundError:
        return True


def _answers(tier: ChildTier) -> bool:
    try:
        tier.size("k")
    except TierUnavailableError:
        return False
    return True


def test_a_child_that_dies_is_replaced(tier: ChildTier) -> None:
    tier.put("k", b"v")
    pid = tier.pid
    assert pid is not None
    os.kill(pid, 9)
    wait_for(lambda: tier.pid != pid, "the dead child replaced")
    wait_for(lambda: _answers(tier), "the next child serving")
    assert tier.restarts == 1


def test_idle_buffers_past_the_pool_are_unmapped_on_both_sides() -> None:
    """A burst of fetches into four buffers, then back to one at a time: what the pool does
    not keep is unmapped in the daemon's process and in the child's."""
    with ChildTier({}, factory=FAKE, call_timeout_s=CALL_S, pool_bytes=2 << 20) as tier:
        tier.put("k", b"v" * 100)
        rooms = [tier.buffer(1 << 20) for _ in range(4)]
        for room in rooms:
            assert tier.get_many_into(["k"], room, 1 << 20) == [100]
        pid = tier.pid
        assert pid is not None and _mapped_buffers(pid) == 4  # the first was the put's staging
        for room in rooms:
            tier.release(room)
        assert len(tier._buffers) == 2  # 2 MiB kept
        tier.put("again", b"x")  # after the unmaps, in order on the socket
        assert _mapped_buffers(pid) == 2
        room = tier.buffer(1 << 20)
        assert tier.get_many_into(["k"], room, 1 << 20) == [100]


def _mapped_buffers(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as f:
        return len({line.split()[4] for line in f if "memfd:prefixd-tier" in line})


def test_the_childs_log_lines_name_no_tier_key(
    tier: ChildTier, capfd: pytest.CaptureFixture[str]
) -> None:
    """Mooncake's client logs the keys of calls that fail; a key is derived from a tenant, an
    identity and a block hash, so the daemon's log shows its tag instead."""
    key = LOGGED + "ma55kXWU-t6jhP0fMFlnB-VUXiJgK"
    tier.put(key, b"x")
    logged: list[str] = []

    def relayed() -> bool:
        logged.append(capfd.readouterr().err)
        return "put failed" in "".join(logged)

    wait_for(relayed, "the child's line relayed")
    assert tag(key) in "".join(logged) and key not in "".join(logged), logged
