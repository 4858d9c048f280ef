"""How long moving `n` bytes takes, fitted to recent moves: the cost side of the benefit model.
The daemon fits one to its loads, the cluster bridge one to its shared-tier fetches."""

from __future__ import annotations

import math
import threading
from collections import Counter, deque

_SAMPLES = 256  # recent moves the model is fitted to
# fitted once this many moves more were seen, so that two early moves never make the line alone
# (the window holds a multiple of it: once full, the line is fitted after every move)
_FIT_EVERY = 8
_UNIT = float(1 << 20)  # sizes are summed in MiB, so that their squares stay well within a double


class LoadTimeModel:
    """Estimated seconds to load `n` bytes: overhead + n / bandwidth, fitted by least squares to
    the recent loads (defaults until loads of at least two sizes were seen). The daemon observes
    every load on its event loop, so the fit is kept as running sums, each observation a constant
    cost (summed again exactly once per window, so rounding never accumulates)."""

    def __init__(self, overhead_s: float = 300e-6, bandwidth: float = 2e9) -> None:
        self._samples: deque[tuple[float, float]] = deque()  # (MiB, seconds), oldest first
        self._sizes: Counter[float] = Counter()  # the samples of each size: a fit needs two
        self._sums = (0.0, 0.0, 0.0, 0.0)  # of x, y, x*x, x*y over the samples
        self._added = 0  # samples added to the sums since they were last summed exactly
        self._lock = threading.Lock()
        self._defaults = (overhead_s, bandwidth)
        self.overhead_s = overhead_s
        self.bandwidth = bandwidth

    def forget(self) -> None:
        """Back to the defaults: the moves seen so far no longer describe the path."""
        with self._lock:
            self._samples.clear()
            self._sizes.clear()
            self._sums, self._added = (0.0, 0.0, 0.0, 0.0), 0
            self.overhead_s, self.bandwidth = self._defaults

    def observe(self, n_bytes: int, seconds: float) -> None:
        x = n_bytes / _UNIT
        with self._lock:
            if len(self._samples) == _SAMPLES:
                self._drop(*self._samples.popleft())
            self._samples.append((x, seconds))
            self._sizes[x] += 1
            self._added += 1
            if self._added >= _SAMPLES:
                self._sum_exactly()
            else:
                sx, sy, sxx, sxy = self._sums
                self._sums = (sx + x, sy + seconds, sxx + x * x, sxy + x * seconds)
            if len(self._samples) % _FIT_EVERY == 0:
                self._fit()

    def _drop(self, x: float, y: float) -> None:
        left = self._sizes[x] - 1
        if left:
            self._sizes[x] = left
        else:
            del self._sizes[x]
        sx, sy, sxx, sxy = self._sums
        self._sums = (sx - x, sy - y, sxx - x * x, sxy - x * y)

    def _sum_exactly(self) -> None:
        samples = self._samples
        self._sums = (
            math.fsum(x for x, _ in samples),
            math.fsum(y for _, y in samples),
            math.fsum(x * x for x, _ in samples),
            math.fsum(x * y for x, y in samples),
        )
        self._added = 0

    def _fit(self) -> None:
        if len(self._sizes) < 2:
            return
        n = len(self._samples)
        sx, sy, sxx, sxy = self._sums
        spread = n * sxx - sx * sx
        if spread <= 0:
            return
        slope = (n * sxy - sx * sy) / spread  # seconds per MiB
        if slope > 0:
            self.bandwidth = _UNIT / slope
            self.overhead_s = max(0.0, (sy - slope * sx) / n)

    def estimate(self, n_bytes: int) -> float:
        return self.overhead_s + n_bytes / self.bandwidth if n_bytes else 0.0
