"""What this process counted since it opened the store: activity for metrics, collisions until the
next sync writes them (a lookup does not write), removals per tenant and reason."""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Activity:
    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0


class Tallies:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._activity: Counter[str] = Counter()  # by Activity's field names
        self._collisions = 0
        self._removals: Counter[tuple[str, str]] = Counter()

    def count(self, **activity: int) -> None:
        """Add to the named `Activity` counts (one lock round per operation)."""
        with self._lock:
            self._activity.update(activity)

    def activity(self) -> Activity:
        with self._lock:
            return Activity(**self._activity)

    def collided(self) -> None:
        with self._lock:
            self._collisions += 1

    def pending_collisions(self) -> int:
        with self._lock:
            return self._collisions

    def take_collisions(self) -> int:
        with self._lock:
            taken, self._collisions = self._collisions, 0
            return taken

    def removed(self, tenant: str, reason: str, blocks: int) -> None:
        """Count removed blocks (a rate, not an inventory: an aborted round's may stay counted)."""
        with self._lock:
            self._removals[tenant, reason] += blocks

    def removals(self) -> dict[str, dict[str, int]]:
        with self._lock:
            tally = dict(self._removals)
        out: dict[str, dict[str, int]] = {}
        for (tenant, reason), blocks in tally.items():
            out.setdefault(tenant, {})[reason] = blocks
        return out
