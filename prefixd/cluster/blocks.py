"""A block as it travels through the shared tier, and how a fetched one is proven before use.

Value layout: magic `PXSB`, format version (u8), 3 reserved bytes, record length (u32 LE), payload
length (u32 LE), crc32c of the payload (u32 LE), then the block's record (prefixd.schema.records:
identity digest, parent hash, token ids and their own crc32c) and the raw payload. The payload's
crc32c is computed at the origin, from bytes the origin verified; the receiver recomputes it, so a
payload damaged anywhere on the way (memory, network, the remote tier) is caught end to end.

Keys are derived from the identity digest and the block hash, `prefixd-<name of the identity>-
<name of the block>` (blake2b names in URL-safe base64: neither the tier nor its logs see a raw
cache key). A tenant's or a model version's objects share their identity's key prefix, which is
how they are found when they are purged.
"""

from __future__ import annotations

import base64
import hashlib
import struct

import crc32c

from prefixd.errors import CorruptRecordError, RemoteBlockError
from prefixd.schema.records import BlockRecord

MAGIC = b"PXSB"
VERSION = 1
_HEAD = struct.Struct("<4sB3xIII")
KEY_PREFIX = "prefixd-"


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


def encode_block(record: bytes, payload: bytes) -> bytes:
    head = _HEAD.pack(MAGIC, VERSION, len(record), len(payload), crc32c.crc32c(payload))
    return head + record + payload


def decode_block(
    value: bytes | memoryview, *, identity_digest: bytes, parent: bytes, tokens: bytes
) -> memoryview:
    """The payload of a fetched value, once it is proven to be the block of these token ids,
    parent and identity, undamaged; RemoteBlockError otherwise."""
    view = memoryview(value)
    if len(view) < _HEAD.size:
        raise RemoteBlockError(f"value of {len(view)} bytes is shorter than its header")
    magic, version, record_len, payload_len, payload_crc = _HEAD.unpack_from(view, 0)
    if magic != MAGIC or version != VERSION:
        raise RemoteBlockError("value has an unknown magic or version")
    if _HEAD.size + record_len + payload_len != len(view):
        raise RemoteBlockError("value length does not match its header")
    try:
        record = BlockRecord.decode(view[_HEAD.size : _HEAD.size + record_len])
    except CorruptRecordError as exc:
        raise RemoteBlockError(f"value's record is damaged: {exc}") from None
    if record.identity != identity_digest or record.parent != parent or record.tokens != tokens:
        raise RemoteBlockError("value holds another block (identity, parent or tokens differ)")
    payload = view[_HEAD.size + record_len :]
    if record.payload_size != payload_len or crc32c.crc32c(payload) != payload_crc:
        raise RemoteBlockError("value's payload fails its checksum")
    return payload
