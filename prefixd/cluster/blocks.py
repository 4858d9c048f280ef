"""A block as it travels through the shared tier, and how a fetched one is proven before use.

Value layout: magic `PXSB`, format version (u8), number of parts (u8), 2 reserved bytes, record
length (u32 LE), payload length (u32 LE), crc32c of the payload (u32 LE); for each part its group
index (u8), 3 reserved bytes, length (u32 LE) and crc32c (u32 LE); then the block's record
(prefixd.schema.records: identity digest, parent hash, token ids and their own crc32c), the raw
payload and the parts' payloads in order. Every crc32c is computed at the origin, from bytes the
origin verified; the receiver recomputes them, so a payload damaged anywhere on the way (memory,
network, the remote tier) is caught end to end.

Parts are a hybrid identity's state-group payloads hung on the block (prefixd.store.joint: a page
on its first block, a checkpoint on the block ending at its boundary). A value without parts is
format 1, which every node reads; a value with parts is format 2. Where a part may hang is the
identity's state spec's business: `decode_block` checks it, so a value whose parts could not have
been stored by an honest origin is refused like a damaged one.

Keys are derived from the identity digest and the block hash, `prefixd-<name of the identity>-
<name of the block>` (blake2b names in URL-safe base64: neither the tier nor its logs see a raw
cache key). A tenant's or a model version's objects share their identity's key prefix, which is
how they are found when they are purged.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c

from prefixd.errors import CorruptRecordError, RemoteBlockError
from prefixd.schema.records import BlockRecord
from prefixd.schema.state import PAGED, StateSpec
from prefixd.store.codec import Buffer

MAGIC = b"PXSB"
VERSION = 1  # without parts
PARTS_VERSION = 2  # with state-group parts
_HEAD = struct.Struct("<4sBB2xIII")
_PART = struct.Struct("<B3xII")
KEY_PREFIX = "prefixd-"


@dataclass(frozen=True, slots=True)
class RemoteBlock:
    """A fetched value, proven: the block's payload and its parts by group index (views into
    the fetched buffer)."""

    payload: memoryview
    parts: dict[int, memoryview]


def block_key(identity_digest: bytes, block: bytes) -> str:
    return identity_prefix(identity_digest) + _name(identity_digest + block, 16)


def identity_prefix(identity_digest: bytes) -> str:
    """The start of every key of one identity's blocks."""
    return f"{KEY_PREFIX}{_name(identity_digest, 9)}-"


def _name(data: bytes, size: int) -> str:
    """A hash of `data` in URL-safe base64: the tier (and its logs) never sees a raw cache key
    or identity digest, only names derived from them the same way on every node."""
    digest = hashlib.blake2b(data, digest_size=size, person=b"prefixd-tier").digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def encoded_size(record: Buffer, payload: Buffer, parts: Sequence[tuple[int, Buffer]] = ()) -> int:
    """The length of the value `encode_block_into` writes."""
    pieces = (record, payload, *(p for _, p in parts))
    return _HEAD.size + len(parts) * _PART.size + sum(memoryview(p).nbytes for p in pieces)


def encode_block_into(
    out: memoryview, record: Buffer, payload: Buffer, parts: Sequence[tuple[int, Buffer]] = ()
) -> None:
    """Write the value of a block into `out` (exactly `encoded_size` bytes): where the tier
    reads it from, with no copy of the payload in between."""
    version = PARTS_VERSION if parts else VERSION
    record_len, payload_len = memoryview(record).nbytes, memoryview(payload).nbytes
    _HEAD.pack_into(
        out, 0, MAGIC, version, len(parts), record_len, payload_len, crc32c.crc32c(payload)
    )
    offset = _HEAD.size
    for group, part in parts:
        _PART.pack_into(out, offset, group, memoryview(part).nbytes, crc32c.crc32c(part))
        offset += _PART.size
    for piece in (record, payload, *(p for _, p in parts)):
        n = memoryview(piece).nbytes
        out[offset : offset + n] = memoryview(piece).cast("B")
        offset += n


def encode_block(
    record: Buffer, payload: Buffer, parts: Sequence[tuple[int, Buffer]] = ()
) -> bytes:
    out = bytearray(encoded_size(record, payload, parts))
    encode_block_into(memoryview(out), record, payload, parts)
    return bytes(out)


def decode_block(
    value: bytes | memoryview,
    *,
    identity_digest: bytes,
    parent: bytes,
    tokens: bytes,
    spec: StateSpec | None = None,
    block_index: int = 0,
    block_tokens: int = 0,
) -> RemoteBlock:
    """The payload and parts of a fetched value, once it is proven to be the block of these
    token ids, parent and identity, undamaged, with parts only where the identity's state spec
    (`spec`, for block `block_index` of `block_tokens` tokens) lets them hang; RemoteBlockError
    otherwise."""
    view = memoryview(value)
    if len(view) < _HEAD.size:
        raise RemoteBlockError(f"value of {len(view)} bytes is shorter than its header")
    magic, version, n_parts, record_len, payload_len, payload_crc = _HEAD.unpack_from(view, 0)
    if (
        magic != MAGIC
        or version not in (VERSION, PARTS_VERSION)
        or ((version == VERSION) != (n_parts == 0))
    ):
        raise RemoteBlockError("value has an unknown magic or version")
    offset = _HEAD.size + n_parts * _PART.size
    if len(view) < offset:
        raise RemoteBlockError("value is shorter than its parts table")
    table = [_PART.unpack_from(view, _HEAD.size + i * _PART.size) for i in range(n_parts)]
    if offset + record_len + payload_len + sum(n for _, n, _ in table) != len(view):
        raise RemoteBlockError("value length does not match its header")
    try:
        record = BlockRecord.decode(view[offset : offset + record_len])
    except CorruptRecordError as exc:
        raise RemoteBlockError(f"value's record is damaged: {exc}") from None
    if record.identity != identity_digest or record.parent != parent or record.tokens != tokens:
        raise RemoteBlockError("value holds another block (identity, parent or tokens differ)")
    offset += record_len
    payload = view[offset : offset + payload_len]
    if record.payload_size != payload_len or crc32c.crc32c(payload) != payload_crc:
        raise RemoteBlockError("value's payload fails its checksum")
    offset += payload_len
    parts: dict[int, memoryview] = {}
    for group, length, crc in table:
        part = view[offset : offset + length]
        offset += length
        if group in parts or not _may_hang(spec, group, block_index, block_tokens):
            raise RemoteBlockError("value has a part its identity's state spec has no place for")
        if not length or crc32c.crc32c(part) != crc:
            raise RemoteBlockError("value's part fails its checksum")
        parts[group] = part
    return RemoteBlock(payload, parts)


def _may_hang(spec: StateSpec | None, group: int, block_index: int, block_tokens: int) -> bool:
    """Whether an origin could have stored a part of `group` on block `block_index`: a page on
    the first block of a page, a checkpoint of a group that stores any, at a boundary its
    policy allows."""
    if spec is None or group >= len(spec):
        return False
    state = spec[group]
    if state.kind == PAGED:
        return block_index % state.page_blocks == 0
    if not state.stored:
        return False
    boundary = (block_index + 1) * block_tokens
    return state.policy != "periodic" or boundary % state.period_tokens == 0
