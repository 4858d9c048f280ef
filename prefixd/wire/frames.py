"""Frames: a length-prefixed msgpack map, and the replies built from them.

A frame is a 4-byte big-endian body length followed by a msgpack map. See docs/protocol.md for
every operation and the evolution rules (new fields get defaults; nothing is renumbered or reused).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, TypeVar

import msgpack

from prefixd.errors import ProtocolError
from prefixd.wire.errors import ErrorCode

PROTOCOL_VERSION = 1
HEADER = struct.Struct(">I")
MAX_FDS_PER_FRAME = 4

T = TypeVar("T")


def encode_frame(message: Mapping[str, Any]) -> bytes:
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes | memoryview) -> dict[str, Any]:
    """Decode a frame body into a map; raises ProtocolError(BAD_FRAME) on anything else."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"body is not valid msgpack ({exc})") from None
    if not isinstance(message, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, "body is not a map")
    return message


def request_id(message: Mapping[str, Any]) -> int:
    rid = message.get("id")
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid < 1 << 63:
        raise ProtocolError(ErrorCode.BAD_FRAME, "'id' must be a non-negative int")
    return rid


def ok_reply(rid: int, **fields: Any) -> dict[str, Any]:
    return {"id": rid, "ok": True, **fields}


def error_reply(rid: int | None, code: ErrorCode, message: str) -> dict[str, Any]:
    return {"id": rid, "ok": False, "error": {"code": code.value, "message": message}}


def field(
    message: Mapping[str, Any],
    name: str,
    kind: type[T] | tuple[type, ...],
    *,
    default: Any = ...,
    code: ErrorCode = ErrorCode.BAD_REQUEST,
) -> T:
    """`message[name]` checked against `kind`; a missing field takes `default` or is an error."""
    if name not in message or message[name] is None:
        if default is ...:
            raise ProtocolError(code, f"field {name!r} is required")
        return default  # type: ignore[no-any-return]
    value = message[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError(code, f"field {name!r} must be {_names(kinds)}, got bool")
    if not isinstance(value, kinds):
        raise ProtocolError(
            code, f"field {name!r} must be {_names(kinds)}, got {type(value).__name__}"
        )
    return value  # type: ignore[no-any-return]


def int_field(
    message: Mapping[str, Any], name: str, *, low: int = 0, high: int = 1 << 62, default: Any = ...
) -> int:
    """An int field within [low, high] (a missing optional field returns its default)."""
    value = field(message, name, int, default=default)
    if value is None and default is None:
        return value  # type: ignore[return-value]
    if not low <= value <= high:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"field {name!r} must be in [{low}, {high}]")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    names = {bytes: "bin", str: "str", int: "int", float: "float", dict: "map", list: "array"}
    return " or ".join(names.get(k, k.__name__) for k in kinds)
