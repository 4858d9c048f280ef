"""What the store holds as shown outside it: one class each for a listing's blocks and
warm-up's prefixes, made by the store, sent by the daemon, returned by the clients."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from prefixd.schema.identity import Identity

Tokens = TypeVar("Tokens")


@dataclass(frozen=True, slots=True)
class ListedBlock:
    """One stored block of a listing: its identity, its packed token ids or engine key, and its
    payload's size."""

    identity: Identity
    tokens: bytes
    payload_size: int

    @property
    def size(self) -> int:
        return self.payload_size


@dataclass(frozen=True, slots=True)
class HotPrefix(Generic[Tokens]):
    """A prefix to warm (Store.hottest, Client.hot): its token ids from token 0 (packed in the
    store, a uint32 array from a client), its blocks' sizes and its best value per byte."""

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
