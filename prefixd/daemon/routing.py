"""Routing answers: what this node would serve a prompt, scored `T_prefill_saved - T_queue -
T_transfer` (T_cold, the engine's, is left to the router).
"""

from __future__ import annotations

import threading

from prefixd.loadtime import LoadTimeModel
from prefixd.wire.messages import RouteReply

_MEAN_WEIGHT = 0.1  # of a finished load in the running mean of a load's bytes


class LoadQueue:
    """The loads under way: their bytes are known once each is done, so the queue's are the loads in
    flight times the mean of a load's bytes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.in_flight = 0
        self.mean_bytes = 0.0

    def started(self) -> None:
        with self._lock:
            self.in_flight += 1

    def finished(self, n_bytes: int) -> None:
        with self._lock:
            self.in_flight -= 1
            if self.mean_bytes == 0.0:
                self.mean_bytes = float(n_bytes)
            else:
                self.mean_bytes += _MEAN_WEIGHT * (n_bytes - self.mean_bytes)

    def queued(self) -> tuple[int, int]:
        """(loads in flight, their estimated bytes)."""
        with self._lock:
            return self.in_flight, int(self.in_flight * self.mean_bytes)


def answer(
    rid: int,
    hit_blocks: int,
    hit_tokens: int,
    hit_bytes: int,
    *,
    load_time: LoadTimeModel,
    prefill_tokens_per_s: float,
    queue: LoadQueue,
) -> RouteReply:
    in_flight, queue_bytes = queue.queued()
    load_s = load_time.estimate(hit_bytes)
    saved_s = hit_tokens / prefill_tokens_per_s
    queue_s = queue_bytes / load_time.bandwidth
    return RouteReply(
        id=rid,
        hit_blocks=hit_blocks,
        hit_tokens=hit_tokens,
        hit_bytes=hit_bytes,
        load_s=load_s,
        prefill_saved_s=saved_s,
        loads_in_flight=in_flight,
        queue_bytes=queue_bytes,
        queue_s=queue_s,
        score_s=saved_s - queue_s - load_s,
    )
