"""The KV events a prefixd tier or spec hands vLLM: keys reported stored, and reported removed once
a lookup or load finds them gone. vLLM's cache-aware routers read them, so a key is reported
removed only after it was reported stored."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from vllm.v1.kv_offload.base import Medium, OffloadingEvent

MAX_REPORTED = 1 << 20  # stored keys remembered for removal events (about 100 MiB at most)


class KeyEvents:
    """Events for `medium`, or none at all when vLLM publishes no KV events (`enabled` false)."""

    def __init__(self, medium: Medium, *, enabled: bool) -> None:
        self._medium = medium
        self._events: list[OffloadingEvent] | None = [] if enabled else None
        self._lock = threading.Lock()  # noted on the job or lookup thread, taken on vLLM's
        self._reported: dict[bytes, None] = {}  # reported stored, oldest first

    @property
    def enabled(self) -> bool:
        return self._events is not None

    @property
    def watching(self) -> bool:
        """Whether some key reported stored may yet be reported removed."""
        return bool(self._reported)

    def note(self, keys: Sequence[bytes], *, removed: bool) -> None:
        """Queue an event for `keys` (stored, or found gone after being reported stored)."""
        if self._events is None or not keys:
            return
        with self._lock:
            if removed:
                keys = [k for k in keys if k in self._reported]
                for key in keys:
                    del self._reported[key]
            else:
                for key in keys:
                    self._reported[key] = None
                while len(self._reported) > MAX_REPORTED:
                    del self._reported[next(iter(self._reported))]
            if keys:
                self._events.append(
                    OffloadingEvent(keys=list(keys), medium=self._medium, removed=removed)
                )

    def take(self) -> Iterable[OffloadingEvent]:
        if self._events is None:
            return ()
        with self._lock:
            events, self._events = self._events, []
        return events


__all__ = ["MAX_REPORTED", "KeyEvents"]
