"""The blocking client polls for replies that come fast and sleeps in recv for the rest
(prefixd.client.polling); the polling clock is injected, so nothing here depends on timing."""

from __future__ import annotations

import gc
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.client.polling import ReplyPolling, RunQueue
from prefixd.errors import ConfigError, DaemonUnavailableError
from prefixd.wire.frames import FrameReader
from tests.daemon.conftest import IDENTITY, Daemon

TOKENS = np.arange(64, dtype=np.uint32)


def idle() -> bool:
    return False  # no other thread waits for a CPU


class Clock:
    """A clock that moves only by `step` at each reading."""

    def __init__(self, step: float = 0.0) -> None:
        self.now = 0.0
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def test_a_fast_reply_is_polled_for_not_slept_for(daemon: Daemon) -> None:
    # a clock that stands still: the budget never runs out, so every reply is polled for
    with Client(daemon.socket, clock=Clock(), crowded=idle) as client:
        before = client.reply_waits
        for _ in range(3):
            assert client.lookup(IDENTITY, [TOKENS])[0].n_blocks == 0
        after = client.reply_waits
    assert after["polled"] - before["polled"] == 3
    assert after["slept"] == before["slept"]


def test_a_kind_of_request_whose_reply_was_slow_sleeps_until_one_is_fast(daemon: Daemon) -> None:
    clock = Clock()
    with Client(daemon.socket, clock=clock, crowded=idle) as client:
        client.lookup(IDENTITY, [TOKENS])
        clock.step = 1.0  # every reading a second later: the next reply "took" seconds
        client.lookup(IDENTITY, [TOKENS])
        clock.step = 0.0
        waits = client.reply_waits
        client.lookup(IDENTITY, [TOKENS])  # the last lookup was slow: this one sleeps
        assert client.reply_waits["slept"] == waits["slept"] + 1
        assert client.reply_waits["polled"] == waits["polled"]
        client.lookup(IDENTITY, [TOKENS])  # the one before was fast again: polled for
        assert client.reply_waits["polled"] == waits["polled"] + 1
        # another kind of request is judged by its own replies
        client.health()
        assert client.reply_waits["polled"] == waits["polled"] + 2


def test_poll_us_zero_always_sleeps(daemon: Daemon) -> None:
    with Client(daemon.socket, poll_us=0, clock=Clock(), crowded=idle) as client:
        for _ in range(3):
            client.lookup(IDENTITY, [TOKENS])
        assert client.reply_waits["polled"] == 0
        assert client.reply_waits["slept"] >= 3


def test_nobody_polls_while_other_threads_wait_for_a_cpu(daemon: Daemon) -> None:
    crowd = [True]
    with Client(daemon.socket, clock=Clock(), crowded=lambda: crowd[0]) as client:
        waits = client.reply_waits
        for _ in range(3):
            client.lookup(IDENTITY, [TOKENS])
        assert client.reply_waits["polled"] == waits["polled"]
        assert client.reply_waits["slept"] == waits["slept"] + 3
        crowd[0] = False
        client.lookup(IDENTITY, [TOKENS])
        assert client.reply_waits["polled"] == waits["polled"] + 1


def test_the_run_queue_is_crowded_past_one_runnable_thread_per_cpu(tmp_path: Path) -> None:
    cpus = os.cpu_count() or 1
    loadavg = tmp_path / "loadavg"
    verdicts = []
    for text in (f"0.5 0.4 0.3 {cpus}/90 123\n", f"0.5 0.4 0.3 {cpus + 1}/90 123\n", "garbage\n"):
        loadavg.write_text(text)
        queue = RunQueue(str(loadavg))
        verdicts.append(queue())
        queue.close()
    assert verdicts == [False, True, True]  # what cannot be read counts as crowded
    assert RunQueue(str(tmp_path / "missing"))()


def _loadavg_fds() -> set[int]:
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/proc/loadavg":
                found.add(int(name))
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
    return found


def test_a_run_queue_never_closed_leaves_no_descriptor_behind() -> None:
    # an engine's link drops a lost client without closing it: its run queue goes with it
    before = _loadavg_fds()
    queues = [RunQueue() for _ in range(8)]
    opened = _loadavg_fds() - before
    assert len(opened) == 8
    del queues
    gc.collect()
    assert not opened & _loadavg_fds()


@pytest.mark.parametrize("poll_us", [-1.0, float("nan")])
def test_a_negative_budget_is_refused(daemon: Daemon, poll_us: float) -> None:
    with pytest.raises(ConfigError, match="poll_us"):
        Client(daemon.socket, poll_us=poll_us)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        yield ours, peer
    finally:
        ours.close()
        peer.close()


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def test_a_frame_cut_short_by_the_budget_is_kept_for_the_sleeping_read(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = pair
    frame = _frame(b"x" * 100)
    frames = FrameReader()
    # the budget runs out at the clock's third reading
    polling = ReplyPolling(250e-6, Clock(step=1e-4), idle)
    peer.sendall(frame[:40])
    assert polling.poll(ours, frames) is None
    peer.sendall(frame[40:])
    got = ours.recv_into(frames.space())
    frames.filled(got)
    body = frames.next_body()
    assert body is not None and bytes(body) == b"x" * 100


def test_a_frame_that_comes_in_pieces_is_polled_for_whole(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = pair
    frame = _frame(b"y" * 64) + _frame(b"z")
    peer.sendall(frame[:10])
    frames = FrameReader()
    polling = ReplyPolling(250e-6, Clock(), idle)
    sent = [False]

    def more() -> float:  # the rest of the frame arrives after the first empty poll
        if not sent[0]:
            sent[0] = True
            peer.sendall(frame[10:])
        return 0.0

    polling.clock = more
    body = polling.poll(ours, frames)
    assert body is not None and bytes(body) == b"y" * 64
    second = frames.next_body()  # what came behind it stays for the next reply
    assert second is not None and bytes(second) == b"z"


def test_a_connection_closed_while_polling_is_a_lost_daemon(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = pair
    peer.close()
    with pytest.raises(DaemonUnavailableError):
        ReplyPolling(250e-6, Clock(), idle).poll(ours, FrameReader())
