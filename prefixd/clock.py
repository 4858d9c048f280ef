"""Time as the store and the daemon read it: one object handed to both, so tests advance it
instead of sleeping (`ManualClock`), stepping through an hour of TTLs in no time and never late
on a busy machine. Durations measured for reports are not read through it: they are
measurements, not decisions.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """What reads the time."""

    def time_ns(self) -> int:
        """Wall-clock nanoseconds since the epoch: when an entry was written or last read."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back: intervals and deadlines."""
        ...


class SystemClock:
    """The machine's clocks."""

    def time_ns(self) -> int:
        return time.time_ns()

    def monotonic(self) -> float:
        return time.monotonic()

    def __repr__(self) -> str:
        return "SystemClock()"


class ManualClock:
    """A clock that stands still until `advance`: both readings move together, by the same
    amount. Thread-safe."""

    def __init__(self, start_ns: int = 1_700_000_000 * 10**9, monotonic: float = 1000.0) -> None:
        self._lock = threading.Lock()
        self._time_ns = start_ns
        self._monotonic = monotonic

    def time_ns(self) -> int:
        with self._lock:
            return self._time_ns

    def monotonic(self) -> float:
        with self._lock:
            return self._monotonic

    def advance(self, seconds: float) -> None:
        """Move both readings forward by `seconds` (never back)."""
        if seconds < 0:
            raise ValueError("a clock does not go back")
        with self._lock:
            self._time_ns += int(seconds * 1e9)
            self._monotonic += seconds

    def __repr__(self) -> str:
        return f"ManualClock(time_ns={self._time_ns}, monotonic={self._monotonic})"


__all__ = ["Clock", "ManualClock", "SystemClock"]
