"""The byte layout of a stored block's record (everything about a block except its payload).

A record is a fixed little-endian header, the block's token ids (the collision defence), and a
crc32c of everything before it, so a damaged record is told apart from a hash collision.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

import crc32c

from prefixd.schema.tokens import TOKEN_BYTES

RECORD_MAGIC = b"PXBR"
RECORD_VERSION = 1

# magic, version, compression, reserved, chunk_bytes, n_chunks, checksum, payload_size,
# stored_size, created_ns, identity digest, parent hash, n_tokens
_HEADER = struct.Struct("<4sBBHIIIQQQ16s16sI")
_TRAILER = struct.Struct("<I")
HEADER_BYTES = _HEADER.size


class Compression(IntEnum):
    """How a record's payload chunks are stored (the on-disk code; never renumber)."""

    NONE = 0
    ZSTD = 1
    ZSTD_PLANES = 2


class CorruptRecordError(Exception):
    """A record fails its checksum or layout; internal to the store, which quarantines the block."""


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """Metadata of one stored block. `tokens` are the block's packed '<u4' token ids."""

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
        body = _HEADER.pack(
            RECORD_MAGIC,
            RECORD_VERSION,
            int(self.compression),
            0,
            self.chunk_bytes,
            self.n_chunks,
            self.checksum,
            self.payload_size,
            self.stored_size,
            self.created_ns,
            self.identity,
            self.parent,
            self.n_tokens,
        ) + self.tokens
        return body + _TRAILER.pack(crc32c.crc32c(body))

    @classmethod
    def decode(cls, data: bytes | memoryview) -> BlockRecord:
        """Parse and verify a record; raises CorruptRecordError on any damage."""
        size = len(data)
        if size < HEADER_BYTES + _TRAILER.size:
            raise CorruptRecordError(f"record is {size} bytes, shorter than its header")
        (stored_crc,) = _TRAILER.unpack_from(data, size - _TRAILER.size)
        if crc32c.crc32c(data[: size - _TRAILER.size]) != stored_crc:
            raise CorruptRecordError("record fails its checksum")
        (
            magic,
            version,
            compression,
            _reserved,
            chunk_bytes,
            n_chunks,
            checksum,
            payload_size,
            stored_size,
            created_ns,
            identity,
            parent,
            n_tokens,
        ) = _HEADER.unpack_from(data, 0)
        if magic != RECORD_MAGIC or version != RECORD_VERSION:
            raise CorruptRecordError("record has an unknown magic or version")
        if HEADER_BYTES + n_tokens * TOKEN_BYTES + _TRAILER.size != size:
            raise CorruptRecordError("record length does not match its token count")
        try:
            kind = Compression(compression)
        except ValueError:
            raise CorruptRecordError(f"record has unknown compression {compression}") from None
        tokens = bytes(data[HEADER_BYTES : HEADER_BYTES + n_tokens * TOKEN_BYTES])
        return cls(
            kind, chunk_bytes, n_chunks, checksum, payload_size, stored_size, created_ns,
            bytes(identity), bytes(parent), tokens,
        )


def chunk_key(block: bytes, index: int) -> bytes:
    """LMDB key of a payload chunk: the block hash then the big-endian index, so chunks sort together."""
    return block + index.to_bytes(4, "big")


