"""What the store holds, as it is shown outside the store: a listing's blocks and warm-up's
prefixes. The store makes them, the daemon sends them, the clients return them (one class each
for all three)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from prefixd.schema.identity import Identity

Tokens = TypeVar("Tokens")


@dataclass(frozen=True, slots=True)
class ListedBlock:
    """One stored block of a listing (Store.list_blocks, Client.list_blocks): its identity
    (named with the tenant asked for), its token ids or engine key (packed), and its payload's
    size."""

    identity: Identity
    tokens: bytes
    payload_size: int

    @property
    def size(self) -> int:
        return self.payload_size


@dataclass(frozen=True, slots=True)
class HotPrefix(Generic[Tokens]):
    """A prefix to warm (Store.hottest, Client.hot): its identity, its token ids from token 0
    (whole blocks: packed '<u4' bytes in the store, a uint32 array from a client), its blocks'
    payload sizes, and the best value per byte among the blocks that put it here."""

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
