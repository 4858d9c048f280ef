"""A block as it travels through the shared tier, and how a fetched one is proven before use.

Value: a header (`_HEAD`: magic, version, part count, record and payload lengths, the payload's
crc32c), a `_PART` entry per part (group, length, crc32c), then the record (prefixd.schema.records),
the payload and the parts. The checksums are computed at the origin from bytes it verified and
checked again here: damage anywhere on the way is caught end to end. Parts are a hybrid identity's
pages and checkpoints; a value with parts is format 2, without format 1. Keys are blake2b names of
the tenant, the identity digest and the block hash: the tier and its logs never see a raw cache
key or a tenant's name; a tenant's keys share a prefix, and so do an identity's, which purges
remove (a tenant's, every node's identities of it).
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import crc32c

from prefixd.errors import CorruptRecordError, RemoteBlockError
from prefixd.schema.identity import Identity
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
    """A proven value: payload and parts by group index (views into the fetch buffer), and when
    its origin stored it (wall clock, ns: a tenant's time to live counts from then)."""

    payload: memoryview
    parts: dict[int, memoryview]
    created_ns: int


def block_key(identity: Identity, block: bytes) -> str:
    return identity_prefix(identity) + _name(identity.digest + block, 16)


def identity_prefix(identity: Identity) -> str:
    return f"{tenant_prefix(identity.tenant)}{_name(identity.digest, 9)}-"


def tenant_prefix(tenant: str) -> str:
    return f"{KEY_PREFIX}{_name(tenant.encode(), 6)}-"


def _name(data: bytes, size: int) -> str:
    digest = hashlib.blake2b(data, digest_size=size, person=b"prefixd-tier").digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")


def encoded_size(record: Buffer, payload: Buffer, parts: Sequence[tuple[int, Buffer]] = ()) -> int:
    pieces = (record, payload, *(p for _, p in parts))
    return _HEAD.size + len(parts) * _PART.size + sum(memoryview(p).nbytes for p in pieces)


def encode_block_into(
    out: memoryview, record: Buffer, payload: Buffer, parts: Sequence[tuple[int, Buffer]] = ()
) -> None:
    """Write a block's value into `out` (exactly `encoded_size` bytes)."""
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
    """The payload and parts of a fetched value, once proven to be the block of these token ids,
    parent and identity, undamaged, with parts only where `spec` lets them hang; RemoteBlockError
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
    return RemoteBlock(payload, parts, record.created_ns)


def _may_hang(spec: StateSpec | None, group: int, block_index: int, block_tokens: int) -> bool:
    """Whether an honest origin could have stored a part of `group` on this block: a page on a
    page's last block, a stored checkpoint at a boundary its policy allows."""
    if spec is None or group >= len(spec):
        return False
    state = spec[group]
    if state.kind == PAGED:
        return (block_index + 1) % state.page_blocks == 0
    if not state.stored:
        return False
    boundary = (block_index + 1) * block_tokens
    return state.policy != "periodic" or boundary % state.period_tokens == 0
