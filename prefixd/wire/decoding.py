"""Frames in and out of the typed messages: `encode`, the daemon's one entry point
`decode_request` (a refused body names the field and the reason, never a value; nesting past the
schema ends in a bad_frame), and the client's `reply_id` and `decode_reply`."""

import re
from typing import Annotated, Any, TypeVar, Union, get_args

import msgspec
from msgspec import Meta, Struct

from prefixd.errors import BadFrameError, RequestError
from prefixd.schema.state import MAX_GROUPS
from prefixd.wire.errors import ErrorCode, error_for
from prefixd.wire.frames import encode_frame
from prefixd.wire.messages import (
    MAX_BLOCKS_PER_PUT,
    MAX_ID,
    MAX_QUOTED,
    REPLIES,
    REQUESTS,
    AnyRequest,
    CheckpointSpans,
    Count,
    ErrorInfo,
    ErrorReply,
    GroupName,
    Id,
    PagedSpans,
    Prompted,
    PutState,
    Reply,
)

# --- encoding -----------------------------------------------------------------------------------


def encode(message: Struct) -> bytes:
    """A whole frame (length header and body) holding `message`, a request or a reply."""
    return encode_frame(message)


# --- decoding requests --------------------------------------------------------------------------


class _Envelope(Struct):
    """What identifies a request, read only when the typed decode failed."""

    id: msgspec.Raw = msgspec.Raw()
    op: msgspec.Raw = msgspec.Raw()


class _PutStateFrame(Prompted, tag="put_state", kw_only=True):
    """put_state with its groups' arrays unbuilt, their lengths summed from the headers first
    (32 groups of 65,536 checkpoints: 12 MiB of msgpack, 270 MiB of tuples once built)."""

    first_block: Count | None = None
    upto_tokens: Count | None = None
    paged: Annotated[dict[GroupName, msgspec.Raw], Meta(max_length=MAX_GROUPS)] | None = None
    checkpoints: Annotated[dict[GroupName, msgspec.Raw], Meta(max_length=MAX_GROUPS)] | None = None


T = TypeVar("T")
_READ_AS: Any = Union[  # noqa: UP007 - built from AnyRequest's members
    tuple(_PutStateFrame if kind is PutState else kind for kind in get_args(AnyRequest))
]
_REQUEST_DECODER = msgspec.msgpack.Decoder(_READ_AS)
_PAGED_DECODER = msgspec.msgpack.Decoder(PagedSpans)
_CHECKPOINTS_DECODER = msgspec.msgpack.Decoder(CheckpointSpans)
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(_Envelope)
_ID_DECODER = msgspec.msgpack.Decoder(Id)
_OP_DECODER = msgspec.msgpack.Decoder(str)

# The code of a refused field, by its path without indices ("prompts.tokens"): `op.path` first,
# then `path`, then the path's parents; any other field is a bad_request. The one table.
_CODES: dict[str, ErrorCode] = {
    "id": ErrorCode.BAD_FRAME,
    "op": ErrorCode.BAD_FRAME,
    "identity": ErrorCode.BAD_IDENTITY,
    "tokens": ErrorCode.BAD_TOKENS,
    "n_tokens": ErrorCode.BAD_TOKENS,
    "hashes": ErrorCode.BAD_TOKENS,
    "prompts.tokens": ErrorCode.BAD_TOKENS,
    "prompts.n_tokens": ErrorCode.BAD_TOKENS,
    "prompts.hashes": ErrorCode.BAD_TOKENS,
    "hot.tenant": ErrorCode.BAD_IDENTITY,  # the tenant whose prefixes to list
}
_AT = " - at "
_NAMED = re.compile(r"^Object (missing required|contains unknown) field `(.*)`$", re.DOTALL)
_INDEX = re.compile(r"\[[^\]]*\]")
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")


def decode_request(body: bytes | bytearray | memoryview) -> AnyRequest:
    """The request a frame body holds; raises RequestError (a ProtocolError) and nothing else."""
    try:
        message = _REQUEST_DECODER.decode(body)
        if isinstance(message, _PutStateFrame):
            return _put_state(message)
        request: AnyRequest = message
        return request
    except msgspec.ValidationError as exc:
        raise _refusal(body, str(exc)) from None
    except msgspec.DecodeError as exc:
        reason = f"body is not valid msgpack ({_redact(exc)})"
        raise RequestError(ErrorCode.BAD_FRAME, reason) from None
    except RecursionError:
        raise RequestError(ErrorCode.BAD_FRAME, "body is nested too deeply") from None


def _put_state(frame: _PutStateFrame) -> PutState:
    """The put_state a frame holds, its groups built only once within MAX_BLOCKS_PER_PUT."""
    paged, checkpoints = frame.paged or {}, frame.checkpoints or {}
    if sum(map(_array_length, [*paged.values(), *checkpoints.values()])) > MAX_BLOCKS_PER_PUT:
        reason = f"put_state: at most {MAX_BLOCKS_PER_PUT} payloads per put (all groups together)"
        raise RequestError(ErrorCode.BAD_REQUEST, reason, rid=frame.id, op="put_state")
    fields = msgspec.structs.asdict(frame)
    fields["paged"] = _groups(frame.paged, _PAGED_DECODER, "paged")
    fields["checkpoints"] = _groups(frame.checkpoints, _CHECKPOINTS_DECODER, "checkpoints")
    return PutState(**fields)


def _groups(
    groups: dict[str, msgspec.Raw] | None, decoder: msgspec.msgpack.Decoder[T], name: str
) -> dict[str, T] | None:
    if groups is None:
        return None
    try:
        return {group: decoder.decode(raw) for group, raw in groups.items()}
    except msgspec.ValidationError as exc:  # "... - at `$[0]`" is "... - at `$.paged[...][0]`"
        what, at, where = str(exc).rpartition(_AT)
        inner = where.strip("`").removeprefix("$") if at else ""
        raise msgspec.ValidationError(f"{what or exc}{_AT}`$.{name}[...]{inner}`") from None


def _array_length(raw: msgspec.Raw) -> int:
    """The element count in a msgpack array's header; 0 for anything else (refused later)."""
    head = memoryview(raw)
    if not head:
        return 0
    if 0x90 <= head[0] <= 0x9F:
        return head[0] & 0x0F
    if head[0] in (0xDC, 0xDD):
        return int.from_bytes(head[1 : 3 if head[0] == 0xDC else 5], "big")
    return 0


def _refusal(body: bytes | bytearray | memoryview, reason: str) -> RequestError:
    """Why a msgpack body is no request: its id and op, then the field at fault."""
    try:
        envelope = _ENVELOPE_DECODER.decode(body)
    except msgspec.ValidationError:
        return RequestError(ErrorCode.BAD_FRAME, "body is not a map with str keys")
    except (msgspec.DecodeError, RecursionError):  # not reached: the typed decode read it all
        return RequestError(ErrorCode.BAD_FRAME, "body is not valid msgpack")
    try:
        rid: int = _ID_DECODER.decode(envelope.id)
    except (msgspec.DecodeError, RecursionError):
        return RequestError(ErrorCode.BAD_FRAME, f"'id' must be an int in [0, {MAX_ID}]")
    try:
        op: str = _OP_DECODER.decode(envelope.op)
    except (msgspec.DecodeError, RecursionError):
        return RequestError(ErrorCode.BAD_FRAME, "'op' must be a str", rid=rid)
    if op not in REQUESTS:
        return RequestError(ErrorCode.UNKNOWN_OP, f"unknown operation {op[:MAX_QUOTED]!r}", rid=rid)
    code, message = field_error(op, reason)
    return RequestError(code, message, rid=rid, op=op)


def field_error(op: str, reason: str) -> tuple[ErrorCode, str]:
    """The code and message for msgspec's ValidationError text `reason` about a request of
    `op`: "Expected `int` >= 0 - at `$.blocks[0][1]`" is a bad_request saying
    "put: blocks[0][1]: expected `int` >= 0"."""
    what, at, where = reason.rpartition(_AT)
    if not at:
        what, where = reason, "`$`"
    in_key = where.startswith("`key` in ")
    path = where.removeprefix("`key` in ").strip("`").removeprefix("$").removeprefix(".")
    named = _NAMED.match(what)
    if named is not None:
        name = named.group(2)[:MAX_QUOTED]
        path = f"{path}.{name}" if path else name
        what = "is required" if named.group(1) == "missing required" else "is not a known field"
    else:
        what = _redact(what)
        what = what[:1].lower() + what[1:]
        if in_key:
            what = f"a key: {what}"
    segments = _INDEX.sub("", path).split(".")
    code = ErrorCode.BAD_REQUEST
    for n in range(len(segments), 0, -1):
        key = ".".join(segments[:n])
        found = _CODES.get(f"{op}.{key}", _CODES.get(key))
        if found is not None:
            code = found
            break
    if not path:
        return code, f"{op}: {what}"
    return code, f"{op}: {path}{'' if what.startswith('is ') else ':'} {what}"


def _redact(reason: object) -> str:
    """An error text without the quoted input it may hold (a byte, a value)."""
    return _QUOTED.sub("…", str(reason))


# --- decoding replies ---------------------------------------------------------------------------

R = TypeVar("R", bound=Reply)


class _ReplyHead(Struct):
    id: int | None = None
    ok: bool = False
    error: ErrorInfo | None = None


_REPLY_DECODERS: "dict[type[Reply], msgspec.msgpack.Decoder[Any]]" = {
    kind: msgspec.msgpack.Decoder(kind) for kind in REPLIES
}
_HEAD_DECODER = msgspec.msgpack.Decoder(_ReplyHead)


def reply_id(body: bytes | bytearray | memoryview) -> int | None:
    """A reply's id (None: the daemon could not read the request's), to match its request."""
    return _head(body).id


def decode_reply(body: bytes | bytearray | memoryview, kind: type[R]) -> R:
    """The reply of type `kind` a body holds; an error reply raises its code's class, anything
    else BadFrameError."""
    decoder = _REPLY_DECODERS.get(kind)
    if decoder is None:
        decoder = _REPLY_DECODERS[kind] = msgspec.msgpack.Decoder(kind)
    try:
        reply: R = decoder.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        refused: Exception = exc  # an error reply, or no reply of this kind: the head says which
    else:
        if reply.ok or kind is ErrorReply:
            return reply
        refused = ValueError("ok is false")
    head = _head(body)
    if head.ok is not True or head.error is not None:
        error = head.error or ErrorInfo(code="unknown", message="an error reply without error")
        raise error_for(error.code, error.message)
    raise BadFrameError(ErrorCode.BAD_FRAME, f"not a {kind.__name__}: {_redact(refused)}")


def _head(body: bytes | bytearray | memoryview) -> _ReplyHead:
    try:
        head: _ReplyHead = _HEAD_DECODER.decode(body)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise BadFrameError(
            ErrorCode.BAD_FRAME, f"reply is no msgpack map ({_redact(exc)})"
        ) from None
    return head


__all__ = ["RequestError", "decode_reply", "decode_request", "encode", "field_error", "reply_id"]
