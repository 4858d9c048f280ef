"""Engine block keys as the chain's words: an engine that names its blocks itself (vLLM's block
hash and group index, an LMCache or SGLang hash) packs its keys, in prefix order, as the
`token_ids` of an identity whose `key_bytes` is their length. Each key takes one block's place in
the chain and is compared on every hit, so it is found only under its identity and parents.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixd.errors import TokenError
from prefixd.schema.identity import Identity


def pack_keys(identity: Identity, keys: Iterable[bytes]) -> bytes:
    """`keys` (in prefix order) as the chain's words; each must be `identity.key_bytes` long."""
    width = identity.key_bytes
    if width is None:
        raise TokenError("engine keys need an engine-keyed identity (key_bytes set)")
    packed = []
    for i, key in enumerate(keys):
        if not isinstance(key, bytes | bytearray | memoryview) or len(key) != width:
            size = len(key) if isinstance(key, bytes | bytearray | memoryview) else None
            raise TokenError(f"engine key {i} is {size} bytes, not {width}")
        packed.append(bytes(key))
    return b"".join(packed)


def unpack_keys(identity: Identity, words: bytes) -> list[bytes]:
    """The keys a packed sequence holds (a hot prefix's, say), in prefix order."""
    width = identity.key_bytes
    if width is None:
        raise TokenError("engine keys need an engine-keyed identity (key_bytes set)")
    return [words[i : i + width] for i in range(0, len(words) - len(words) % width, width)]


__all__ = ["pack_keys", "unpack_keys"]
