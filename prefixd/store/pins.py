"""Blocks held from eviction between a lookup and its load (LMCache's lookup-and-lock, then load).

A pin is an in-memory count per block: eviction never chooses a pinned block, and a round that chose
one pinned meanwhile rolls back. Pins hold off only eviction: purges, expiry and quarantine still
remove a pinned block."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class Pins:
    """How many holders each pinned block has. `lock` orders pinning against an eviction round's
    commit (the pinner reads the block again after pinning)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._held: Counter[bytes] = Counter()

    def hold(self, hashes: Iterable[bytes]) -> None:
        with self.lock:
            self._held.update(hashes)

    def release(self, hashes: Iterable[bytes]) -> None:
        with self.lock:
            held = self._held
            for h in hashes:
                held[h] -= 1
                if held[h] <= 0:
                    del held[h]

    def held(self, block: bytes) -> bool:
        return block in self._held

    def any_held(self, blocks: Iterable[bytes]) -> bool:
        """Call with `lock` held to act on the answer."""
        held = self._held
        return any(b in held for b in blocks)

    def __len__(self) -> int:
        return len(self._held)
