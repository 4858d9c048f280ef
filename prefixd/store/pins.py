"""Blocks held from eviction while a caller is between finding them and reading them.

An engine that looks a prefix up and loads it a moment later (LMCache's lookup-and-lock, then
load) must not see the daemon's eviction take the blocks in between. A pin is a count per block
hash, in memory only: eviction never chooses a pinned block, and a round that chose a block
which got pinned while it ran rolls back and starts again (prefixd.store.eviction). Pins only
hold eviction off: a purge, a retirement, expiry or quarantine still removes a pinned block
(a damaged block is never served, pinned or not). They belong to the process that holds the
store; the daemon releases a connection's pins when the connection ends.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable


class Pins:
    """How many holders each pinned block has. `lock` orders pinning against the commit of an
    eviction round: a pin taken after the check cannot be undone by that round's commit, since
    the pinner reads the block again after pinning (Store.pin)."""

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
                left = held.get(h, 0) - 1
                if left > 0:
                    held[h] = left
                else:
                    held.pop(h, None)

    def held(self, block: bytes) -> bool:
        """Whether `block` is pinned now (one dict read: eviction asks for every leaf)."""
        return block in self._held

    def any_held(self, blocks: Iterable[bytes]) -> bool:
        """Whether any of `blocks` is pinned; call with `lock` held to act on the answer."""
        held = self._held
        return any(b in held for b in blocks)

    def __len__(self) -> int:
        return len(self._held)
