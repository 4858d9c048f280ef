"""Whether fetching blocks from the shared tier beats prefilling their tokens: the cost side a
model of the recent fetches (prefixd.loadtime), the gain side the prefill they save.

The model learns only from fetches, so a tier that was slow for a while (a master restarting,
a call that waited out its timeout) could leave it advising against every fetch for good. A
fetch it advises against is therefore still made every `PROBE_S`; when it beats the prefill,
the model forgets what it learned and learns again.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prefixd.loadtime import LoadTimeModel

PROBE_S = 5.0  # a fetch the model advises against is still made this often


class FetchBenefit:
    """The benefit model of one bridge (prefixd.cluster.bridge)."""

    def __init__(self, prefill_tokens_per_s: float, now: Callable[[], float]) -> None:
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.fetch_time = LoadTimeModel(overhead_s=2e-3, bandwidth=1e9)
        self._now = now
        self._next_probe = now() + PROBE_S
        self._lock = threading.Lock()

    def saved_s(self, block_tokens: int, blocks: int) -> float:
        """The prefill time `blocks` blocks save."""
        return blocks * block_tokens / self.prefill_tokens_per_s

    def worth_it(self, block_tokens: int, blocks: int, bytes_per_block: float) -> bool:
        """Whether fetching `blocks` blocks of about `bytes_per_block` bytes beats prefilling
        them (always, while the size of a block is not known)."""
        if not bytes_per_block:
            return True
        fetch_s = self.fetch_time.estimate(int(bytes_per_block * blocks))
        return fetch_s < self.saved_s(block_tokens, blocks)

    def probe_due(self) -> bool:
        """Whether a fetch the model advises against is made anyway (one per `PROBE_S`)."""
        now = self._now()
        with self._lock:
            if now < self._next_probe:
                return False
            self._next_probe = now + PROBE_S
            return True

    def probed(self, took_s: float, block_tokens: int, blocks: int) -> None:
        """A probe fetched `blocks` blocks in `took_s`: if that beat their prefill, the model
        was stale."""
        if took_s < self.saved_s(block_tokens, blocks):
            self.fetch_time.forget()
