"""Whether fetching blocks from the shared tier beats prefilling their tokens.

The model learns only from fetches, so a tier slow for a while could leave it advising against every
fetch for good: a fetch it advises against is still made every `PROBE_S`, and one that beats the
prefill makes it forget and learn again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prefixd.loadtime import LoadTimeModel

PROBE_S = 5.0  # a fetch the model advises against is still made this often


class FetchBenefit:
    def __init__(self, prefill_tokens_per_s: float, now: Callable[[], float]) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.fetch_time = LoadTimeModel(overhead_s=2e-3, bandwidth=1e9)
        self._now = now
        self._next_probe = now() + PROBE_S
        self._lock = threading.Lock()

    def saved_s(self, block_tokens: int, blocks: int) -> float:
        return blocks * block_tokens / self.prefill_tokens_per_s

    def worth_it(self, block_tokens: int, blocks: int, bytes_per_block: float) -> bool:
        """Whether fetching beats prefilling (always, while a block's size is unknown)."""
        if not bytes_per_block:
            return True
        fetch_s = self.fetch_time.estimate(int(bytes_per_block * blocks))
        return fetch_s < self.saved_s(block_tokens, blocks)

    def probe_due(self) -> bool:
        now = self._now()
        with self._lock:
            if now < self._next_probe:
                return False
            self._next_probe = now + PROBE_S
            return True

    def probed(self, took_s: float, block_tokens: int, blocks: int) -> None:
        """A probe that beat the prefill: the model was stale."""
        if took_s < self.saved_s(block_tokens, blocks):
            self.fetch_time.forget()
