"""The background thread of the periodic durability mode: flush access times, then fsync.

A failed fsync is no exception here: the store's sync state records it (prefixd.store.sync_state)
and the store refuses writes from then on, so nothing is swallowed but a bug's traceback, logged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class PeriodicSyncer:
    """Calls `flush` every `interval_s` seconds on a daemon thread until stopped."""

    def __init__(self, flush: Callable[[], object], interval_s: float) -> None:
        self._flush = flush
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="prefixd-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._flush()
            except Exception:  # a bug: keep going (the flush fsyncs whatever else failed)
                log.exception("periodic store sync failed")

    def stop(self) -> None:
        """Stop the thread and wait for a flush in progress to finish."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
