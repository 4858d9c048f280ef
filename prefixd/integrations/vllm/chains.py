"""A request's vLLM keys in prefix order, per KV group: the chains PrefixdTier stores and looks up.

Store jobs come in any order, so the order is the end-token position vLLM's scheduler records for
each key in the ReqContext; a group's chain runs from its first chunk to the first gap.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

KEY_BYTES = 36  # vLLM's OffloadKey: block hash (32) + big-endian group index (4)
_GROUP_BYTES = 4


def group_of(key: bytes) -> int:
    return int.from_bytes(key[-_GROUP_BYTES:], "big")


class Chain(NamedTuple):
    """One group's keys of a request in prefix order, and each key's place in it."""

    keys: list[bytes]
    places: dict[bytes, int]


NO_CHAIN = Chain([], {})


def positions_of(req_context: Any) -> dict[bytes, int]:
    """A snapshot of the keys' end-token positions: one C-level dict copy, so the scheduler
    thread, which goes on adding keys, pays almost nothing for it."""
    positions: dict[bytes, int] = getattr(req_context, "_offload_key_positions", {})
    return positions.copy()


class Chains:
    """A request's chains by KV group; a key after a gap has none: never stored or reported."""

    def __init__(self, tokens_per_chunk: Mapping[int, int]) -> None:
        self._tokens_per_chunk = dict(tokens_per_chunk)

    def closes_chunk(self, key: bytes, end_token: int | None) -> bool:
        """Whether `key`, ending at `end_token`, closes a chunk of its group's chain."""
        span = self._tokens_per_chunk.get(group_of(key))
        return span is not None and end_token is not None and end_token % span == 0

    def of(self, positions: Mapping[bytes, int]) -> dict[int, Chain]:
        by_group: dict[int, dict[int, bytes]] = {}
        for key, end_token in positions.items():
            group = group_of(key)
            span = self._tokens_per_chunk.get(group)
            if span is None or end_token % span:
                continue  # a boundary key of another group's kind: not a chunk of the chain
            by_group.setdefault(group, {})[end_token // span - 1] = key
        chains = {}
        for group, keys in by_group.items():
            chain: list[bytes] = []
            while len(chain) in keys:
                chain.append(keys[len(chain)])
            chains[group] = Chain(chain, {key: i for i, key in enumerate(chain)})
        return chains


__all__ = ["KEY_BYTES", "NO_CHAIN", "Chain", "Chains", "group_of", "positions_of"]
