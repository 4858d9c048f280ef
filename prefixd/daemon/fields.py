"""What handlers read from a request's fields beside the store: token ids, closed tokens, where a
load writes, and the packed integers replies carry.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence

from prefixd.daemon.peer import Peer
from prefixd.errors import ProtocolError
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TOKEN_BYTES
from prefixd.wire.errors import ErrorCode
from prefixd.wire.messages import Load, LoadState, Span, TokenFields


def token_count(fields: TokenFields, most: int, where: str = "") -> int:
    """How many token ids a prompt names, refused past `most` before any is read."""
    span: Span | None = fields.tokens_span
    count = span[2] if span is not None else len(fields.tokens or b"") // TOKEN_BYTES
    if count > most:
        raise ProtocolError(
            ErrorCode.BAD_TOKENS,
            f"{where}tokens: {count} token ids, at most {most} per prompt (max_prompt_tokens)",
        )
    return count


def request_tokens(peer: Peer, fields: TokenFields, where: str = "") -> bytes | memoryview:
    """Packed token ids, inline (`tokens`) or in a shared region (`tokens_span`, which keeps a long
    prompt off the socket): exactly one, agreeing with `n_tokens` if given."""
    span: Span | None = fields.tokens_span
    tokens: bytes | memoryview | None = fields.tokens
    if span is not None:
        if tokens is not None:
            raise ProtocolError(ErrorCode.BAD_TOKENS, f"{where}tokens and tokens_span both given")
        region, offset, count = span
        tokens = peer.span((region, offset, count * TOKEN_BYTES))
    elif tokens is None:
        raise ProtocolError(ErrorCode.BAD_TOKENS, f"{where}tokens (or tokens_span) is required")
    if len(tokens) % TOKEN_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_TOKENS, f"{where}tokens is {len(tokens)} bytes, not a multiple of 4"
        )
    count = len(tokens) // TOKEN_BYTES
    declared = fields.n_tokens
    if declared is not None and declared != count:
        raise ProtocolError(
            ErrorCode.BAD_TOKENS, f"{where}tokens holds {count} token ids, n_tokens says {declared}"
        )
    return tokens


def closed_tokens(tokens: bytes | memoryview, identity: Identity) -> int:
    """A prompt's tokens in closed blocks (for an engine-keyed identity, those its closed keys stand
    for)."""
    return len(tokens) // TOKEN_BYTES // identity.block_words * identity.block_tokens


def region_output(peer: Peer, msg: Load | LoadState) -> tuple[int, memoryview]:
    """Where a load writes: `region` from `offset` (0) for `length` (to its end)."""
    region = peer.region(msg.region)
    offset = msg.offset or 0
    length = max(0, region.size - offset) if msg.length is None else msg.length
    return offset, region.span(offset, length)


def packed(values: Sequence[int]) -> bytes:
    """Little-endian uint64s (array.array packs three times quicker than numpy)."""
    out = array.array("Q", values)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()
