"""The byte layout of a stored block's record: a fixed little-endian header, the block's token
ids (the collision defence) and a crc32c, so a damaged record is told apart from a collision.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import NamedTuple

import crc32c

from prefixd.errors import CorruptRecordError
from prefixd.schema.tokens import TOKEN_BYTES

RECORD_MAGIC = b"PXBR"
RECORD_VERSION = 1

# magic, version, compression, reserved, chunk_bytes, n_chunks, checksum, payload_size,
# stored_size, created_ns, identity digest, parent hash, n_tokens
_HEADER = struct.Struct("<4sBBHIIIQQQ16s16sI")
_TRAILER = struct.Struct("<I")
_ACCESS = struct.Struct("<QII")  # last access ns, hits, reserved
HEADER_BYTES = _HEADER.size
# Byte offsets of the fields the lookup path compares in bulk.
PAYLOAD_SIZE_AT = 20
CREATED_AT = 36
IDENTITY_AT = 44
PARENT_AT = 60
TOKENS_AT = HEADER_BYTES


def record_bytes(n_tokens: int) -> int:
    """Encoded length of a record holding `n_tokens` token ids."""
    return HEADER_BYTES + n_tokens * TOKEN_BYTES + _TRAILER.size


def record_prefix() -> bytes:
    """The first five bytes every record of this version starts with (magic and version)."""
    return RECORD_MAGIC + bytes([RECORD_VERSION])


class Compression(IntEnum):
    """How a record's payload chunks are stored (the on-disk code; never renumber)."""

    NONE = 0
    ZSTD = 1
    ZSTD_PLANES = 2


_COMPRESSIONS = tuple(Compression)  # indexable by code, cheaper than Compression(code)


class BlockRecord(NamedTuple):
    """Metadata of one stored block; `tokens` are its packed '<u4' token ids. A NamedTuple: the
    lookup path decodes one per block, and tuple construction is the cheapest."""

    compression: Compression
    chunk_bytes: int
    n_chunks: int
    checksum: int
    payload_size: int
    stored_size: int
    created_ns: int
    identity: bytes
    parent: bytes
    tokens: bytes

    @property
    def n_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    def encode(self) -> bytes:
        # the fields from chunk_bytes to parent lie in the header in their own order
        header = _HEADER.pack(
            RECORD_MAGIC, RECORD_VERSION, int(self.compression), 0, *self[1:9], self.n_tokens
        )
        body = header + self.tokens
        return body + _TRAILER.pack(crc32c.crc32c(body))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> BlockRecord:
        """Parse and verify a record; raises CorruptRecordError on any damage."""
        size = len(data)
        if size < HEADER_BYTES + _TRAILER.size:
            raise CorruptRecordError(f"record is {size} bytes, shorter than its header")
        body = memoryview(data)[: size - _TRAILER.size]
        if crc32c.crc32c(body) != _TRAILER.unpack_from(data, size - _TRAILER.size)[0]:
            raise CorruptRecordError("record fails its checksum")
        magic, version, compression, _reserved, *fields, n_tokens = _HEADER.unpack_from(data, 0)
        if magic != RECORD_MAGIC or version != RECORD_VERSION:
            raise CorruptRecordError("record has an unknown magic or version")
        if HEADER_BYTES + n_tokens * TOKEN_BYTES != len(body):
            raise CorruptRecordError("record length does not match its token count")
        if compression >= len(_COMPRESSIONS):
            raise CorruptRecordError(f"record has unknown compression {compression}")
        return cls._make((_COMPRESSIONS[compression], *fields, bytes(body[HEADER_BYTES:])))


class AccessRecord(NamedTuple):
    """When a block was last read and how often (schema version 2; version 1 kept only the
    time). Written in batches, never on the read path: a crash loses at most the last batch."""

    last_ns: int
    hits: int

    def encode(self) -> bytes:
        return _ACCESS.pack(self.last_ns, min(self.hits, 0xFFFFFFFF), 0)

    @classmethod
    def read(cls, data: bytes | memoryview | None, default_ns: int) -> AccessRecord:
        """The stored record, or a fresh one (never read) if it is missing or unreadable."""
        if data is not None:
            try:
                return cls.decode(data)
            except CorruptRecordError:
                pass
        return cls(default_ns, 0)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> AccessRecord:
        if len(data) != _ACCESS.size:
            raise CorruptRecordError(f"access record is {len(data)} bytes, not {_ACCESS.size}")
        last_ns, hits, _reserved = _ACCESS.unpack(data)
        return cls(last_ns, hits)


def chunk_key(block: bytes, index: int) -> bytes:
    """LMDB key of a payload chunk: the block hash then the big-endian index, so chunks sort together."""
    return block + index.to_bytes(4, "big")


PART_MAGIC = b"PXPT"
PART_VERSION = 1
# magic, version, compression, group, reserved, block index, chunk_bytes, n_chunks, checksum,
# payload_size, stored_size, created_ns
_PART = struct.Struct("<4sBBBBIIIIQQQ")


class PartRecord(NamedTuple):
    """Metadata of one state-group payload hung on a block of a hybrid identity: a page (on its
    first block) or a checkpoint (on the block ending at its boundary). Its field names match
    BlockRecord's payload fields, so the codec reads either."""

    compression: Compression
    group: int
    block_index: int
    chunk_bytes: int
    n_chunks: int
    checksum: int
    payload_size: int
    stored_size: int
    created_ns: int

    def encode(self) -> bytes:
        # the fields from block_index on lie in the record in their own order
        body = _PART.pack(PART_MAGIC, PART_VERSION, int(self.compression), self.group, 0, *self[2:])
        return body + _TRAILER.pack(crc32c.crc32c(body))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> PartRecord:
        """Parse and verify a part record; raises CorruptRecordError on any damage."""
        if len(data) != _PART.size + _TRAILER.size:
            raise CorruptRecordError(f"part record is {len(data)} bytes, not {_PART.size + 4}")
        if (
            crc32c.crc32c(memoryview(data)[: _PART.size])
            != _TRAILER.unpack_from(data, _PART.size)[0]
        ):
            raise CorruptRecordError("part record fails its checksum")
        magic, version, compression, group, _reserved, *rest = _PART.unpack_from(data, 0)
        if magic != PART_MAGIC or version != PART_VERSION:
            raise CorruptRecordError("part record has an unknown magic or version")
        if compression >= len(_COMPRESSIONS):
            raise CorruptRecordError(f"part record has unknown compression {compression}")
        return cls(_COMPRESSIONS[compression], group, *rest)


def part_key(block: bytes, group: int) -> bytes:
    """LMDB key of a part: the block hash then the group's index in the state spec. Its chunks
    are `chunk_key(part_key(...), n)`, so deleting a block's chunks by prefix takes them too."""
    return block + bytes((group,))
