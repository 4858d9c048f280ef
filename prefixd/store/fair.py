"""Threads that copy and verify the payloads of every load at once, a piece of each in turn.

Round robin over the loads in flight, so a huge load never makes a small one wait, and only
`threads` pieces run at once (more only evict each other from the cache). A caller returns only once
every started piece of its job has ended, so its bytes are in place before it reports or closes the
read transaction."""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Sequence

Piece = Callable[[], bool]  # runs one piece; False: it failed, or was stopped (see FairPool.run)


def default_threads() -> int:
    """About one thread per usable core, at least 2."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 2
    return max(2, min(64, cores))


class _Job:
    __slots__ = ("done", "error", "next", "outcomes", "pieces", "running", "stop_at")

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.pieces = pieces
        self.outcomes: list[bool | None] = [None] * len(pieces)
        self.next = 0  # the next piece to start
        self.stop_at = len(pieces)  # no piece from here on starts (a failure moves it down)
        self.running = 0
        self.error: BaseException | None = None
        self.done = threading.Event()

    def startable(self) -> bool:
        return self.next < self.stop_at


class FairPool:
    def __init__(self, threads: int, name: str = "prefixd-copy") -> None:
        if threads < 1:
            raise ValueError("a FairPool needs at least one thread")
        self.threads = threads
        self._name = name
        self._cond = threading.Condition()
        self._jobs: deque[_Job] = deque()  # jobs with a piece left to start, in turn
        self._workers: list[threading.Thread] = []
        self._closed = False

    def run(self, pieces: Sequence[Piece]) -> list[bool | None]:
        """Run `pieces` interleaved with other callers'; return each outcome: True, False, or None
        for a piece never started after an earlier one failed. Returns once every started piece has
        ended, raising the first exception one raised. After `close`, runs them here."""
        job = _Job(pieces)
        if not pieces:
            return job.outcomes
        with self._cond:
            queued = not self._closed
            if queued:
                self._start_threads()
                self._jobs.append(job)
                self._cond.notify(min(len(pieces), self.threads))
        if not queued:
            for index, piece in enumerate(pieces):
                job.outcomes[index] = ok = piece()
                if not ok:
                    break
            return job.outcomes
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.outcomes

    def close(self) -> None:
        """Stop the threads once queued jobs have started every piece; later jobs run on their
        callers' threads."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            workers, self._workers = self._workers, []
        for worker in workers:
            if worker is not threading.current_thread():
                worker.join()

    def _start_threads(self) -> None:
        while len(self._workers) < self.threads:
            worker = threading.Thread(
                target=self._work, name=f"{self._name}-{len(self._workers)}", daemon=True
            )
            worker.start()
            self._workers.append(worker)

    def _work(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._jobs:
                    if self._closed:
                        return
                    cond.wait()
                job = self._jobs.popleft()
                index = job.next
                job.next += 1
                job.running += 1
                if job.startable():
                    self._jobs.append(job)  # its next piece after one of every other job's
            ok = False
            error: BaseException | None = None
            try:
                ok = bool(job.pieces[index]())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                error = exc
            with cond:
                job.running -= 1
                job.outcomes[index] = ok if error is None else False
                if error is not None and job.error is None:
                    job.error = error
                if not ok and index + 1 < job.stop_at:
                    job.stop_at = index + 1
                    if job in self._jobs and not job.startable():
                        self._jobs.remove(job)
                if job.running == 0 and not job.startable():
                    job.done.set()
