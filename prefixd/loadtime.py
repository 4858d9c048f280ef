"""How long moving `n` bytes takes, fitted to recent moves: the cost side of the benefit model.
The daemon fits one to its loads, the cluster bridge one to its shared-tier fetches."""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

_SAMPLES = 256  # recent moves the model is fitted to


class LoadTimeModel:
    """Estimated seconds to load `n` bytes: overhead + n / bandwidth, fitted by least squares to
    the recent loads (defaults until loads of at least two sizes were seen)."""

    def __init__(self, overhead_s: float = 300e-6, bandwidth: float = 2e9) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=_SAMPLES)
        self._lock = threading.Lock()
        self._defaults = (overhead_s, bandwidth)
        self.overhead_s = overhead_s
        self.bandwidth = bandwidth

    def forget(self) -> None:
        """Back to the defaults: the moves seen so far no longer describe the path."""
        with self._lock:
            self._samples.clear()
            self.overhead_s, self.bandwidth = self._defaults

    def observe(self, n_bytes: int, seconds: float) -> None:
        with self._lock:
            self._samples.append((float(n_bytes), seconds))
            if len(self._samples) >= 8 and len(self._samples) % 8 == 0:
                self._fit()

    def _fit(self) -> None:
        sizes, times = np.array(self._samples).T
        if np.ptp(sizes) <= 0:
            return
        slope, intercept = np.polyfit(sizes, times, 1)
        if slope > 0:
            self.bandwidth = 1.0 / slope
            self.overhead_s = max(0.0, float(intercept))

    def estimate(self, n_bytes: int) -> float:
        return self.overhead_s + n_bytes / self.bandwidth if n_bytes else 0.0
