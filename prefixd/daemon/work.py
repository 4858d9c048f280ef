"""Thread pools that know which of their work is still running, so that shutdown can wait for it
within the grace period and then knows whether it may close the store or must leave it be.

A future that was queued but never started is cancelled with its request; one that started runs to
its end on its thread whatever happens on the event loop. `WorkPool.unfinished` lists those, and
`WorkPool.running` counts the ones a thread has picked up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class WorkPool(ThreadPoolExecutor):
    """A ThreadPoolExecutor that tracks its futures until they are done."""

    def __init__(self, max_workers: int | None = None, thread_name_prefix: str = "") -> None:
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self._unfinished: set[Future[Any]] = set()
        self._running = 0

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        def run() -> T:
            with self._lock:
                self._running += 1
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self._running -= 1

        future = super().submit(run)
        with self._lock:
            self._unfinished.add(future)
        future.add_done_callback(self._finished)  # at once when it is already done
        return future

    def _finished(self, future: Future[Any]) -> None:
        with self._lock:
            self._unfinished.discard(future)

    def unfinished(self) -> list[Future[Any]]:
        """The futures not done yet: queued, or running on a thread."""
        with self._lock:
            return list(self._unfinished)

    @property
    def running(self) -> int:
        """How many calls threads are running now."""
        with self._lock:
            return self._running


__all__ = ["WorkPool"]
