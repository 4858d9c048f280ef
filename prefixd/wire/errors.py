"""Error codes on the wire and the exception class of each, in one table for both directions:
the daemon names the code of what it raised (`code_of`), a client raises the class (`error_for`).
"""

from __future__ import annotations

from enum import Enum

from prefixd import errors


class ErrorCode(str, Enum):
    """Machine-readable error codes, never renumbered or reused (docs/protocol.md)."""

    BAD_FRAME = "bad_frame"  # body is not a msgpack map with an int id and a str op
    FRAME_TOO_LARGE = "frame_too_large"
    HELLO_REQUIRED = "hello_required"
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_OP = "unknown_op"
    BAD_REQUEST = "bad_request"  # a field is missing, of the wrong type or out of range
    BAD_IDENTITY = "bad_identity"
    BAD_TOKENS = "bad_tokens"
    BAD_REGION = "bad_region"
    OPEN_TAIL = "open_tail"
    ORPHAN = "orphan"
    COLLISION = "collision"
    BAD_PAYLOAD = "bad_payload"
    STORE_FULL = "store_full"  # the map or the disk is full: rolled back, reads go on
    WRITE_FAILED = "write_failed"  # the disk refused a write (an I/O error): rolled back
    STORE_DAMAGED = "store_damaged"  # a damaged page of the store: see `prefixd verify`
    BUSY = "busy"
    FORBIDDEN = "forbidden"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"
    SYNC_FAILED = "sync_failed"  # an fsync of the store failed: writes refused, reads go on


# The class a client raises for each code. A class's subclasses share its code (DiskFullError is a
# store_full on the wire, and a StoreFullError again in the client).
ERROR_CLASSES: dict[ErrorCode, type[errors.PrefixdError]] = {
    ErrorCode.BAD_FRAME: errors.BadFrameError,
    ErrorCode.FRAME_TOO_LARGE: errors.FrameTooLargeError,
    ErrorCode.HELLO_REQUIRED: errors.HelloRequiredError,
    ErrorCode.UNSUPPORTED_VERSION: errors.UnsupportedVersionError,
    ErrorCode.UNKNOWN_OP: errors.UnknownOperationError,
    ErrorCode.BAD_REQUEST: errors.BadRequestError,
    ErrorCode.BAD_IDENTITY: errors.IdentityError,
    ErrorCode.BAD_TOKENS: errors.TokenError,
    ErrorCode.BAD_REGION: errors.RegionError,
    ErrorCode.OPEN_TAIL: errors.OpenTailError,
    ErrorCode.ORPHAN: errors.OrphanBlockError,
    ErrorCode.COLLISION: errors.BlockCollisionError,
    ErrorCode.BAD_PAYLOAD: errors.PayloadError,
    ErrorCode.STORE_FULL: errors.StoreFullError,
    ErrorCode.WRITE_FAILED: errors.StoreWriteError,
    ErrorCode.STORE_DAMAGED: errors.CorruptStoreError,
    ErrorCode.BUSY: errors.BusyError,
    ErrorCode.FORBIDDEN: errors.ForbiddenError,
    ErrorCode.SHUTTING_DOWN: errors.ShuttingDownError,
    ErrorCode.INTERNAL: errors.InternalError,
    ErrorCode.SYNC_FAILED: errors.SyncFailedError,
}
_CODES = frozenset(code.value for code in ErrorCode)


def code_of(exc: BaseException) -> ErrorCode | None:
    """The code the daemon replies with for `exc`, or None when it is no error of prefixd's
    (a bug: the daemon logs it and replies `internal`)."""
    if isinstance(exc, errors.ProtocolError) and exc.code in _CODES:
        return ErrorCode(exc.code)
    if isinstance(exc, errors.PrefixdError) and type(exc).code in _CODES:
        return ErrorCode(type(exc).code)
    return None


def error_for(code: str, message: str) -> errors.PrefixdError:
    """The exception a client raises for an error reply: the class of `code`, or RemoteError
    for a code this client does not know."""
    try:
        kind = ERROR_CLASSES[ErrorCode(code)]
    except ValueError:
        return errors.RemoteError(code, message)
    return kind.from_wire(message)
