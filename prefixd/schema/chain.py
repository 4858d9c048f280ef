"""The prefix chain: block i is named by a hash of (identity digest, parent hash, its tokens),
or of its engine key for an engine-keyed identity. The inputs have fixed widths, so the join is
unambiguous; xxh3-128 gives 128 bits against accidental collisions at ~10 GB/s, and the store
compares tokens, parent and identity on every hit, so any collision is a miss, never wrong data.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import xxhash

from prefixd.errors import TokenError
from prefixd.schema.content import chain_words
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TOKEN_BYTES, TOKEN_DTYPE, PromptIds

HASH_BYTES = 16
ROOT_PARENT = bytes(HASH_BYTES)
_CHAIN_DOMAIN = b"prefixd.chain.v1\x00"


def block_hash(identity_digest: bytes, parent: bytes, block_tokens: bytes) -> bytes:
    """Hash of one block given its parent's hash and its packed '<u4' token ids."""
    return xxhash.xxh3_128_digest(b"".join((_CHAIN_DOMAIN, identity_digest, parent, block_tokens)))


class BlockChain:
    """The closed blocks of one token sequence under one identity, hashed lazily in order."""

    def __init__(
        self, identity: Identity, token_ids: PromptIds, hashes: bytes | None = None
    ) -> None:
        """`hashes`: the closed blocks' hashes, packed, as a client sends them. They only choose
        which records a walk reads (it compares tokens and parents), so a wrong one is a miss."""
        self.identity = identity
        tokens = chain_words(identity, token_ids)
        # A private snapshot (bytes input is immutable already): tokens read from memory a client
        # shares cannot change between hashing and comparing.
        self._bytes = token_ids if isinstance(token_ids, bytes) else tokens.tobytes()
        self.tokens = np.frombuffer(self._bytes, dtype=TOKEN_DTYPE)
        # The words that name one block: its token ids (then its content digest, for an identity
        # with request_content), or an engine-keyed identity's key.
        self.block_tokens = identity.block_words
        self.n_blocks = len(self.tokens) // self.block_tokens
        # the prompt's tokens: those its closed blocks stand for, then its open tail's
        tail = len(self.tokens) - self.n_blocks * self.block_tokens
        self.n_tokens = self.n_blocks * identity.block_tokens + tail
        self._span = self.block_tokens * TOKEN_BYTES
        self._hashes: list[bytes] = []
        self._supplied = b""
        if hashes is not None:
            if len(hashes) != self.n_blocks * HASH_BYTES:
                raise TokenError(
                    f"{len(hashes)} bytes of block hashes for {self.n_blocks} closed blocks "
                    f"(expected {self.n_blocks * HASH_BYTES})"
                )
            self._supplied = bytes(hashes)

    def block_bytes(self, index: int) -> bytes:
        """Packed '<u4' token ids of block `index`."""
        span = self._span
        return self._bytes[index * span : (index + 1) * span]

    def parent_of(self, index: int) -> bytes:
        return ROOT_PARENT if index == 0 else self.hash(index - 1)

    def hash(self, index: int) -> bytes:
        """Hash of block `index`; computes (and remembers) every hash before it first."""
        if not 0 <= index < self.n_blocks:
            raise IndexError(f"block {index} is not a closed block of this sequence")
        if self._supplied:
            return self._supplied[index * HASH_BYTES : (index + 1) * HASH_BYTES]
        return self.hashes_until(index + 1)[index]

    @property
    def token_bytes(self) -> bytes:
        """All token ids, packed '<u4' (a private snapshot)."""
        return self._bytes

    def adopt(self, hashes: tuple[bytes, ...] | list[bytes]) -> None:
        """Take the first hashes from a prefix verified earlier for these very tokens, so a put
        that extends a long chain hashes only its own blocks (supplied hashes are kept)."""
        if self._supplied or len(hashes) <= len(self._hashes):
            return
        if len(hashes) > self.n_blocks:
            raise IndexError(f"{len(hashes)} hashes for {self.n_blocks} closed blocks")
        self._hashes = list(hashes)

    @property
    def known_hashes(self) -> int:
        """How many leading block hashes are already computed (or were supplied)."""
        return self.n_blocks if self._supplied else len(self._hashes)

    def hashes_until(self, stop: int) -> list[bytes]:
        """The remembered hash list, extended to at least blocks 0..stop-1 (do not modify it)."""
        hashes = self._hashes
        if len(hashes) < stop and self._supplied:
            packed, size = self._supplied, HASH_BYTES
            end = min(stop, self.n_blocks) * size
            hashes.extend(packed[i : i + size] for i in range(len(hashes) * size, end, size))
        elif len(hashes) < stop:
            head = _CHAIN_DOMAIN + self.identity.digest
            data, span = self._bytes, self._span
            parent = hashes[-1] if hashes else ROOT_PARENT
            digest = xxhash.xxh3_128_digest
            for offset in range(len(hashes) * span, min(stop, self.n_blocks) * span, span):
                parent = digest(b"".join((head, parent, data[offset : offset + span])))
                hashes.append(parent)
        return hashes

    def __iter__(self) -> Iterator[bytes]:
        for i in range(self.n_blocks):
            yield self.hash(i)

    def hashes(self) -> list[bytes]:
        """Every closed block's hash, in order."""
        return list(self.hashes_until(self.n_blocks))


def packed_hashes(identity: Identity, token_ids: PromptIds) -> bytes:
    """Every closed block's hash packed back to back: the wire form a client sends."""
    return b"".join(BlockChain(identity, token_ids).hashes())


def chain_hashes(identity: Identity, token_ids: PromptIds) -> list[bytes]:
    """Hashes of every closed block of `token_ids`; an open tail contributes nothing."""
    return BlockChain(identity, token_ids).hashes()


__all__ = ["HASH_BYTES", "ROOT_PARENT", "BlockChain", "block_hash", "chain_hashes", "packed_hashes"]
