"""Prefixes a walk has verified, kept in memory so a repeated lookup skips re-reading them.

An engine looks up the same long prompts again and again. A walk that verified blocks 0..n-1 of a
chain (identity, parent links and token ids, record by record) is remembered under its last block's
hash with a copy of those token ids. A later query is served from it only if its identity is the
same, its token ids start with exactly those bytes (one memcmp), and no block has been removed from
the store since: every removal, in any process, bumps the store's removal epoch in the same
transaction. Blocks are immutable while they exist (one owner), so nothing else can invalidate it.
The walk then continues from block n as usual, so blocks added since are found too.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from prefixd.schema.chain import BlockChain


@dataclass(frozen=True, slots=True)
class VerifiedPrefix:
    epoch: int
    identity: bytes
    tokens: bytes
    hashes: tuple[bytes, ...]
    payload_sizes: tuple[int, ...]


class VerifiedPrefixes:
    """A bounded LRU of verified prefixes (bounded by the bytes of token ids it holds)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, VerifiedPrefix] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0

    def find(self, chain: BlockChain, epoch: int, limit: int) -> VerifiedPrefix | None:
        """The longest remembered prefix of `chain` (at most `limit` blocks) still valid at `epoch`."""
        if not self.max_bytes or not self._entries:
            return None
        digest = chain.identity.digest
        with self._lock:
            entries = self._entries
            for index in range(limit - 1, -1, -1):  # the longest first; usually the last hits
                h = chain.hash(index)
                entry = entries.get(h)
                if (
                    entry is not None
                    and entry.epoch == epoch
                    and entry.identity == digest
                    and len(entry.hashes) <= limit
                    and chain.token_bytes.startswith(entry.tokens)
                ):
                    entries.move_to_end(h)
                    self.hits += 1
                    return entry
        return None

    def remember(
        self,
        chain: BlockChain,
        epoch: int,
        hashes: list[bytes],
        payload_sizes: list[int],
    ) -> None:
        """Keep a prefix a walk verified (blocks 0..len(hashes)-1 of `chain`)."""
        if not self.max_bytes or not hashes:
            return
        tokens = chain.token_bytes[: len(hashes) * chain.block_tokens * 4]
        if len(tokens) > self.max_bytes:
            return
        entry = VerifiedPrefix(
            epoch, chain.identity.digest, tokens, tuple(hashes), tuple(payload_sizes)
        )
        with self._lock:
            old = self._entries.pop(hashes[-1], None)
            if old is not None:
                self._bytes -= len(old.tokens)
            self._entries[hashes[-1]] = entry
            self._bytes += len(tokens)
            while self._bytes > self.max_bytes:
                _, dropped = self._entries.popitem(last=False)
                self._bytes -= len(dropped.tokens)
