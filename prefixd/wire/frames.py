"""Frames: a 4-byte big-endian body length followed by a msgpack map.

The messages a frame holds are typed structs (prefixd.wire.messages), decoded in one place with
their limits. See docs/protocol.md for every operation and the evolution rules (new fields get
defaults; nothing is renumbered or reused).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any

import msgpack
import msgspec

from prefixd.errors import ProtocolError
from prefixd.wire.errors import ErrorCode

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
MAX_FDS_PER_FRAME = 4


def _enc_hook(value: Any) -> Any:
    """What msgpack-python packs and msgspec does not: subclasses of float (numpy's float64)
    and integers that only implement __index__ (numpy's integers)."""
    if isinstance(value, float):
        return float(value)
    index = getattr(value, "__index__", None)
    if index is not None:
        return index()
    raise NotImplementedError(f"cannot encode a {type(value).__name__}")


_STRUCTS = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode_frame(message: Mapping[str, Any] | msgspec.Struct) -> bytes:
    """A whole frame: a message struct (see prefixd.wire.decoding.encode) or a plain map."""
    body: bytes
    if isinstance(message, msgspec.Struct):
        body = _STRUCTS.encode(message)
    else:
        body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes | memoryview) -> dict[str, Any]:
    """A frame body as a plain map, untyped (the daemon decodes requests with
    prefixd.wire.decoding.decode_request); raises ProtocolError(BAD_FRAME) on anything else."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack ({exc})") from None
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "body is not a map")
    return message
