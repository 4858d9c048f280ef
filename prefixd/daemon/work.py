"""Thread pools that know which of their work still runs, so that shutdown can wait for it within
the grace period and know whether it may close the store.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


class WorkPool(ThreadPoolExecutor):
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
        """Queued, or running on a thread."""
        with self._lock:
            return list(self._unfinished)

    @property
    def running(self) -> int:
        with self._lock:
            return self._running
