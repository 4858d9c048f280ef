"""The lookup memo: prefixes a walk verified, so a repeated lookup skips re-reading them.

An entry is served only if its identity matches, the query's token ids start with its bytes, and no
block was removed since (every removal bumps the removal epoch in its own transaction). Blocks are
immutable while they exist, so nothing else can invalidate it."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from prefixd.schema.chain import BlockChain
from prefixd.store.walk import Walk


@dataclass(frozen=True, slots=True)
class VerifiedPrefix:
    epoch: int
    identity: bytes
    tokens: bytes
    hashes: tuple[bytes, ...]
    payload_sizes: tuple[int, ...]
    content: bytes  # _content_key(identity, tokens)
    oldest_created_ns: int  # entries of a tenant with a time to live expire with their oldest block

    def walk(self) -> Walk:
        return Walk(
            list(self.hashes), list(self.payload_sizes), oldest_created_ns=self.oldest_created_ns
        )


class VerifiedPrefixes:
    """A bounded LRU of verified prefixes (bounded by the memory they take)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, VerifiedPrefix] = OrderedDict()
        # The same entries by a digest of (identity, token ids): a repeated query whose block
        # hashes are not at hand finds its entry with one hash of its bytes instead of a chain.
        self._by_content: dict[bytes, bytes] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._floor = 0  # a purge's epoch: a walk older than it is not remembered (its tokens)
        self.hits = 0

    def find(
        self, chain: BlockChain, epoch: int, limit: int, min_created_ns: int = 0
    ) -> VerifiedPrefix | None:
        """The longest remembered prefix of `chain`, at most `limit` blocks, valid at `epoch`."""
        if not self.max_bytes or not self._entries:
            return None
        digest = chain.identity.digest
        closed = memoryview(chain.token_bytes)[: limit * chain.block_tokens * 4]
        content = _content_key(digest, closed)

        def fits(n_blocks: int) -> Callable[[VerifiedPrefix], bool]:
            return lambda entry: (
                len(entry.hashes) == n_blocks and chain.token_bytes.startswith(entry.tokens)
            )

        # the exact entry, else a shorter remembered prefix (a shared system prompt, say) under
        # its last block's hash, the longest first; an entry counts only if it ends at the block
        # whose hash found it (the hashes may be a client's, and wrong)
        shorter = ((chain.hash(index), index + 1) for index in range(limit - 1, -1, -1))
        with self._lock:
            for key, n_blocks in itertools.chain([(self._by_content.get(content), limit)], shorter):
                entry = self._valid(key, digest, epoch, min_created_ns, fits(n_blocks))
                if entry is not None:
                    return entry
        return None

    def _valid(
        self,
        key: bytes | None,
        digest: bytes,
        epoch: int,
        min_created_ns: int,
        fits: Callable[[VerifiedPrefix], bool],
    ) -> VerifiedPrefix | None:
        """The entry under `key` if it is still valid and `fits` the query (call under the lock)."""
        entry = self._entries.get(key) if key is not None else None
        if (
            entry is None
            or entry.epoch != epoch
            or entry.oldest_created_ns < min_created_ns
            or entry.identity != digest
            or not fits(entry)
        ):
            return None
        self._entries.move_to_end(entry.hashes[-1])
        self.hits += 1
        return entry

    def find_whole(
        self, identity_digest: bytes, closed: np.ndarray, epoch: int, min_created_ns: int = 0
    ) -> VerifiedPrefix | None:
        """The entry that is exactly these closed blocks' token ids, still valid; `closed` may be a
        client's shared memory, read, never kept."""
        if not self.max_bytes or not self._entries:
            return None
        raw = closed.data.cast("B")
        content = _content_key(identity_digest, raw)

        def fits(entry: VerifiedPrefix) -> bool:  # one memcmp (equal lengths: equal bytes)
            return len(entry.tokens) == closed.nbytes and entry.tokens.startswith(raw)

        with self._lock:
            key = self._by_content.get(content)
            return self._valid(key, identity_digest, epoch, min_created_ns, fits)

    def remember(
        self,
        chain: BlockChain,
        epoch: int,
        hashes: list[bytes],
        payload_sizes: list[int],
        oldest_created_ns: int,
        replacing: bytes | None = None,
    ) -> None:
        """Keep a prefix a walk verified. `replacing`: the last hash of the prefix it grew from,
        dropped so a prompt growing block by block holds one entry."""
        if not self.max_bytes or not hashes:
            return
        if replacing is not None and replacing != hashes[-1]:
            with self._lock:
                self._forget(replacing)
        tokens = chain.token_bytes[: len(hashes) * chain.block_tokens * 4]
        if _cost(tokens, hashes) > self.max_bytes:
            return
        digest = chain.identity.digest
        content = _content_key(digest, tokens)
        entry = VerifiedPrefix(
            epoch, digest, tokens, tuple(hashes), tuple(payload_sizes), content, oldest_created_ns
        )
        with self._lock:
            if epoch < self._floor:  # a walk from before a purge: its tokens may be the purged's
                return
            self._forget(hashes[-1])
            self._entries[hashes[-1]] = entry
            self._by_content[content] = hashes[-1]
            self._bytes += _cost(tokens, entry.hashes)
            while self._bytes > self.max_bytes:
                self._forget(next(iter(self._entries)))  # the least recently used

    def forget_identities(self, digests: Collection[bytes], epoch: int) -> None:
        """Drop every entry of these identities: a purged tenant's token ids leave memory with it,
        not at some later eviction. `epoch`: the purge's; a walk that began before it, and ends
        after, remembers nothing."""
        with self._lock:
            self._floor = max(self._floor, epoch)
            for key in [key for key, entry in self._entries.items() if entry.identity in digests]:
                self._forget(key)

    def _forget(self, key: bytes) -> None:
        """Drop the entry under `key`, if any (call under the lock)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= _cost(entry.tokens, entry.hashes)
            if self._by_content.get(entry.content) == key:
                del self._by_content[entry.content]


# What an entry costs beyond its token bytes, measured with sys.getsizeof: per block a 16-byte
# bytes object (49 B) in a tuple (8 B) and a size in another tuple (8 B + a 28 B int); per entry
# the entry, its tuples, its content key and two dict slots.
_BLOCK_COST = 96
_ENTRY_COST = 512


def _cost(tokens: bytes | memoryview, hashes: Sequence[bytes]) -> int:
    return len(tokens) + _BLOCK_COST * len(hashes) + _ENTRY_COST


def _content_key(identity_digest: bytes, tokens: bytes | memoryview) -> bytes:
    """Finds an entry only: a hit is still checked byte for byte."""
    state = xxhash.xxh3_128(identity_digest)
    state.update(tokens)
    return state.digest()
