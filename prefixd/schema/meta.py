"""The store's one meta record: MAGIC (8 bytes) | schema version (u32 LE) | settings length
(u32 LE) | settings (msgpack map) | crc32c (u32 LE). Magic and version sit at fixed offsets in
every version, so any prefixd tells "not a store", "another version" and "corrupt" apart.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import crc32c
import msgpack

from prefixd.errors import CorruptMetaError, NotAStoreError, SchemaVersionError

MAGIC = b"PREFIXD\x00"
# 2: access records hold a hit count (prefixd.migrate.access_hits)
# 3: per-identity stored-byte counters (prefixd.migrate.per_identity)
SCHEMA_VERSION = 5
_HEAD = struct.Struct("<8sII")
_CRC = struct.Struct("<I")

# What this code's records mean; a store whose meta says otherwise is not readable as-is.
FORMAT_SETTINGS: dict[str, Any] = {
    "chain_hash": "xxh3-128",
    "identity_digest": "blake2b-128",
    "payload_checksum": "crc32c",
    "token_dtype": "<u4",
}


@dataclass(frozen=True)
class StoreMeta:
    """The decoded meta record."""

    schema_version: int
    settings: dict[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        settings: bytes = msgpack.packb(self.settings, use_bin_type=True)
        body = _HEAD.pack(MAGIC, self.schema_version, len(settings)) + settings
        return body + _CRC.pack(crc32c.crc32c(body))

    @classmethod
    def decode(cls, data: bytes, *, supported: int | None = SCHEMA_VERSION) -> StoreMeta:
        """Parse a meta record (`supported=None`: any version up to this code's, to migrate);
        raises NotAStoreError, CorruptMetaError or SchemaVersionError."""
        if len(data) < len(MAGIC) or data[: len(MAGIC)] != MAGIC:
            raise NotAStoreError("meta record does not start with the prefixd magic")
        if len(data) < _HEAD.size + _CRC.size:
            raise CorruptMetaError("meta record is truncated")
        (stored_crc,) = _CRC.unpack_from(data, len(data) - _CRC.size)
        if crc32c.crc32c(data[: len(data) - _CRC.size]) != stored_crc:
            raise CorruptMetaError("meta record fails its checksum")
        _magic, version, settings_len = _HEAD.unpack_from(data, 0)
        if version != (supported or version) or version > SCHEMA_VERSION:
            raise SchemaVersionError(version, supported or SCHEMA_VERSION)
        if _HEAD.size + settings_len + _CRC.size != len(data):
            raise CorruptMetaError("meta record length does not match its settings length")
        try:
            settings = msgpack.unpackb(data[_HEAD.size : _HEAD.size + settings_len], raw=False)
        except (ValueError, msgpack.UnpackException) as exc:
            raise CorruptMetaError(f"meta settings cannot be decoded: {exc}") from None
        if not isinstance(settings, dict):
            raise CorruptMetaError("meta settings are not a map")
        return cls(version, settings)


def with_version(meta: StoreMeta, version: int, **settings: Any) -> StoreMeta:
    """`meta` stamped with another schema version (and settings changed; None removes one)."""
    merged = {**meta.settings, **settings}
    return StoreMeta(version, {k: v for k, v in merged.items() if v is not None})


def new_meta(created_ns: int) -> StoreMeta:
    return StoreMeta(SCHEMA_VERSION, {**FORMAT_SETTINGS, "created_ns": created_ns})
