"""How the blocking client waits for a reply: polling the socket briefly before it sleeps in recv.

Where idle cores halt (a VM without guest halt-polling, a deep C-state), the wake-up from recv is
most of a short request's time: polling took a 131,072-token lookup on the README's 2-vCPU VM from
183-200 us to 111-150 us. Polling costs CPU, so it is bounded by a budget per reply, by kind of
request (as haltpoll adapts its window: only while the last reply of that kind came within the
budget, so a load polls once and then sleeps), and by the run queue: it polls only while no
thread waits for a CPU. sched_yield instead was measured worse (4 client processes on 2 CPUs:
lookup p99 3.7 ms against 0.5 ms asleep).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import BinaryIO

from prefixd.errors import ConfigError, DaemonUnavailableError
from prefixd.wire.frames import FrameReader

DEFAULT_POLL_US = 500.0  # covers a hello, a lookup and a small put; a load sleeps
CROWD_CHECK_EVERY = 8  # empty polls (a few microseconds each) between looks at the run queue


class RunQueue:
    """Whether the kernel has more runnable threads than CPUs (/proc/loadavg's runnable count,
    one pread of a descriptor kept open, about 2 us); unreadable counts as crowded."""

    def __init__(self, path: str = "/proc/loadavg") -> None:
        self._cpus = os.cpu_count() or 1
        self._file: BinaryIO | None
        try:  # a file object: closed with it if a dropped client is never closed
            self._file = open(path, "rb", buffering=0)  # noqa: SIM115 - kept open with the client
        except OSError:
            self._file = None

    def __call__(self) -> bool:
        file = self._file
        if file is None or file.closed:
            return True
        try:
            runnable = int(os.pread(file.fileno(), 128, 0).split()[3].split(b"/")[0])
        except (OSError, ValueError, IndexError):
            return True
        return runnable > self._cpus

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


class ReplyPolling:
    """The polling budget, and how long the last reply of each kind of request took."""

    def __init__(
        self,
        budget_s: float,
        clock: Callable[[], float],
        crowded: Callable[[], bool] | None = None,
    ) -> None:
        if not budget_s >= 0:  # NaN too
            raise ConfigError(f"poll_us must be >= 0, got {budget_s * 1e6!r}")
        self.budget_s = budget_s
        self.clock = clock
        self._run_queue = RunQueue() if crowded is None and budget_s else None
        self.crowded = crowded or self._run_queue or (lambda: True)
        self._took: dict[type, float] = {}  # kind of request -> seconds its last reply took
        self.polled = 0  # replies picked up by polling
        self.slept = 0  # replies waited for asleep in recv

    def worth(self, kind: type) -> bool:
        """Whether a reply to a request of `kind` is likely to come within the budget."""
        return self.budget_s > 0 and self._took.get(kind, 0.0) <= self.budget_s

    def took(self, kind: type, seconds: float) -> None:
        """A reply to a request of `kind` came `seconds` after the request was sent."""
        self._took[kind] = seconds

    def close(self) -> None:
        if self._run_queue is not None:
            self._run_queue.close()

    def before_sleeping(
        self, sock: socket.socket, frames: FrameReader, kind: type
    ) -> memoryview | None:
        """The reply, polled for when that is worth it; None when the caller is to sleep in recv."""
        body = self.poll(sock, frames) if self.worth(kind) else None
        if body is None:
            self.slept += 1
        return body

    def poll(self, sock: socket.socket, frames: FrameReader) -> memoryview | None:
        """The next reply's body if it comes within the budget; None once the budget is spent or
        another thread waits for a CPU (a partial frame stays in `frames`)."""
        if self.crowded():
            return None  # another thread wants a CPU: leave it to them
        clock = self.clock
        end = clock() + self.budget_s
        empty = 0
        while True:
            try:
                got = sock.recv_into(frames.space(), 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if clock() >= end:
                    return None
                empty += 1
                if empty % CROWD_CHECK_EVERY == 0 and self.crowded():
                    return None
                continue
            if not got:
                raise DaemonUnavailableError("the daemon closed the connection")
            frames.filled(got)
            body = frames.next_body()
            if body is not None:
                self.polled += 1
                return body


__all__ = ["DEFAULT_POLL_US", "ReplyPolling", "RunQueue"]
