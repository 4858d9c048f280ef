"""The periodic sync thread; a failed fsync is recorded by the sync state, not raised here."""

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
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
