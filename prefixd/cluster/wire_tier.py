"""The messages between the daemon and its tier process: msgpack over a SOCK_SEQPACKET pair, one
message per call or reply. A failed reply carries the error's class name, message and Mooncake's
code, raised again as that class on the parent's side.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from prefixd.errors import TierError

MAX_MESSAGE = 1 << 20
"""Largest message either side sends: calls carry keys, never values."""


def _hierarchy(cls: type[TierError]) -> list[type[TierError]]:
    """`cls` and every class below it, however deep: a new one crosses the socket as itself."""
    return [cls, *(below for sub in cls.__subclasses__() for below in _hierarchy(sub))]


_ERRORS: dict[str, type[TierError]] = {cls.__name__: cls for cls in _hierarchy(TierError)}


class TierStart(Struct, frozen=True):
    """The first message: how the child opens its tier, and how many calls it runs at once."""

    factory: str
    settings: dict[str, Any]
    workers: int


class TierCall(Struct, frozen=True):
    """`map` sends a buffer (a memfd) before any call names it, `unmap` retires it after the last
    (neither is answered); `put`, `get_into` and `get_many_into` name `buffer`, `offset` and
    `length` in it."""

    id: int
    op: str
    keys: list[str] = []
    buffer: int = 0
    offset: int = 0
    length: int = 0
    capacity: int = 0
    flag: bool = False


class TierReply(Struct, frozen=True):
    """`error`: the class name; `in_flight`: the child's calls still running (one that timed out
    there may still write into its buffer)."""

    id: int
    result: Any = None
    error: str = ""
    message: str = ""
    code: int | None = None
    in_flight: int = 0


def error_reply(call_id: int, exc: Exception, in_flight: int) -> TierReply:
    """The reply that raises `exc` again on the other side (a TierError for anything else)."""
    name = type(exc).__name__ if type(exc).__name__ in _ERRORS else "TierError"
    message = str(exc) if isinstance(exc, TierError) else f"{type(exc).__name__}: {exc}"
    code = getattr(exc, "code", None) if isinstance(exc, TierError) else None
    code = code if isinstance(code, int) else None  # Mooncake's code, not the wire's
    return TierReply(id=call_id, error=name, message=message, code=code, in_flight=in_flight)


def raise_error(reply: TierReply) -> None:
    if reply.error:
        raise _ERRORS.get(reply.error, TierError)(reply.message, reply.code)
