"""What this process counted since it opened the store.

Lookups, hits and loads are rates for the daemon's metrics; hash collisions wait here until the
next sync writes them to the counters table (a lookup does not write); removals are counted per
tenant and reason. All of it lives in memory under one lock: none of it is inventory (the
counters table, kept in the data's own transactions, is).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Activity:
    """Lookups and loads since the store was opened."""

    lookups: int = 0
    hit_blocks: int = 0
    loaded_blocks: int = 0
    loaded_bytes: int = 0


class Tallies:
    """This process's counts; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lookups = self._hit_blocks = self._loaded_blocks = self._loaded_bytes = 0
        self._collisions = 0
        self._removals: Counter[tuple[str, str]] = Counter()

    def count(
        self,
        *,
        lookups: int = 0,
        hit_blocks: int = 0,
        loaded_blocks: int = 0,
        loaded_bytes: int = 0,
    ) -> None:
        """Add to the activity counts (one call per operation, so one lock round)."""
        with self._lock:
            self._lookups += lookups
            self._hit_blocks += hit_blocks
            self._loaded_blocks += loaded_blocks
            self._loaded_bytes += loaded_bytes

    def activity(self) -> Activity:
        with self._lock:
            return Activity(
                self._lookups, self._hit_blocks, self._loaded_blocks, self._loaded_bytes
            )

    def collided(self) -> None:
        """A stored block's hash turned out to be owned by other tokens (counted, then synced)."""
        with self._lock:
            self._collisions += 1

    def pending_collisions(self) -> int:
        with self._lock:
            return self._collisions

    def take_collisions(self) -> int:
        """The collisions not yet written to the counters table, now handed to the caller."""
        with self._lock:
            taken, self._collisions = self._collisions, 0
            return taken

    def removed(self, tenant: str, reason: str, blocks: int) -> None:
        """Count removed blocks (after the write commits the count may run ahead of a
        transaction that aborted: it is a rate, not an inventory)."""
        with self._lock:
            self._removals[tenant, reason] += blocks

    def removals(self) -> dict[str, dict[str, int]]:
        """Blocks removed, per tenant and reason."""
        with self._lock:
            tally = dict(self._removals)
        out: dict[str, dict[str, int]] = {}
        for (tenant, reason), blocks in tally.items():
            out.setdefault(tenant, {})[reason] = blocks
        return out
