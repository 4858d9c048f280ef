"""What the store holds as shown outside it: one class each for a listing's blocks and
warm-up's prefixes, made by the store, sent by the daemon, returned by the clients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from prefixd.schema.identity import Identity

Tokens = TypeVar("Tokens")


@dataclass(frozen=True, slots=True)
class ListedBlock:
    """One stored block of a listing: its identity, its packed chain words (token ids, then the
    content digest under request_content) or engine key, and its payload's size."""

    identity: Identity
    tokens: bytes
    payload_size: int

    @property
    def size(self) -> int:
        return self.payload_size


@dataclass(frozen=True, slots=True)
class HotPrefix(Generic[Tokens]):
    """A prefix to warm (Store.hottest, Client.hot): its chain words from token 0 (packed in the
    store, a uint32 array from a client): the token ids, with each block's content digest for an
    identity with request_content (such a prefix loads back as `tokens.tobytes()`); its blocks'
    sizes and its best value per byte."""

    identity: Identity
    tokens: Tokens
    payload_sizes: tuple[int, ...]
    score: float

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.payload_sizes

    @property
    def payload_bytes(self) -> int:
        return sum(self.payload_sizes)
