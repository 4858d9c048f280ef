"""Bytes <-> stored chunks: compression and checksums, with no knowledge of LMDB.

A payload is cut into chunks of `chunk_bytes`; each chunk is compressed on its own, so each decodes
straight into its place in the destination. The checksum (crc32c, which releases the GIL) covers the
stored bytes of all chunks in order and is verified before a byte is reported to a caller; on the raw
path it runs on a second thread while the payload is being copied.
"""

from __future__ import annotations

import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

import crc32c
import numpy as np
import zstandard

from prefixd.schema.records import BlockRecord, Compression

_PLANE_HEADER = struct.Struct("<I")
COMPRESSION_BY_NAME = {
    "none": Compression.NONE,
    "zstd": Compression.ZSTD,
    "zstd-planes": Compression.ZSTD_PLANES,
}

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, slots=True)
class EncodedPayload:
    """A payload as it will be stored."""

    compression: Compression
    chunks: list[Buffer]
    chunk_bytes: int
    payload_size: int
    stored_size: int
    checksum: int


@dataclass(frozen=True, slots=True)
class StoredPayload:
    """One block to decode: its record, its chunk views (valid only inside the read transaction)
    and where its payload goes."""

    record: BlockRecord
    chunks: list[memoryview]
    dest: memoryview


@dataclass
class CodecCounters:
    """Bytes and seconds spent in the codec since the store was opened."""

    compress_in_bytes: int = 0
    compress_out_bytes: int = 0
    compress_s: float = 0.0
    stored_raw_after_trial: int = 0
    decompress_out_bytes: int = 0
    decompress_s: float = 0.0
    copied_bytes: int = 0
    verified_bytes: int = 0
    verify_failures: int = 0


def checksum(chunks: Sequence[Buffer]) -> int:
    """crc32c over the chunks in order (the GIL is released for large chunks)."""
    value = 0
    for chunk in chunks:
        value = crc32c.crc32c(chunk, value)
    return value


def _checksums(groups: Sequence[Sequence[Buffer]]) -> list[int]:
    return [checksum(chunks) for chunks in groups]


def _as_array(buffer: Buffer) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint8)


class PayloadCodec:
    """Encodes payloads for storage and decodes verified ones into caller buffers."""

    def __init__(
        self, compression: str, *, level: int, min_gain: float, chunk_bytes: int
    ) -> None:
        self.compression = COMPRESSION_BY_NAME[compression]
        self.level = level
        self.min_gain = min_gain
        self.chunk_bytes = chunk_bytes
        self.counters = CodecCounters()
        self._lock = threading.Lock()
        self._local = threading.local()

    # --- encoding ------------------------------------------------------------------------------

    def encode(self, payload: memoryview) -> EncodedPayload:
        """Chunk, maybe compress, and checksum a payload. Compression that does not save at least
        `min_gain` of the bytes is dropped: the payload is stored raw and loads at copy speed."""
        size = payload.nbytes
        step = self.chunk_bytes
        raw = [payload[off : off + step] for off in range(0, size, step)]
        kind = self.compression
        if kind is Compression.ZSTD_PLANES and size % 2:
            kind = Compression.ZSTD
        if kind is not Compression.NONE:
            started = time.perf_counter()
            packed = [self._compress_chunk(kind, chunk) for chunk in raw]
            stored = sum(len(c) for c in packed)
            with self._lock:
                self.counters.compress_in_bytes += size
                self.counters.compress_out_bytes += stored
                self.counters.compress_s += time.perf_counter() - started
            if stored <= size * (1.0 - self.min_gain):
                return EncodedPayload(kind, packed, step, size, stored, checksum(packed))
            with self._lock:
                self.counters.stored_raw_after_trial += 1
        return EncodedPayload(Compression.NONE, raw, step, size, size, checksum(raw))

    def _compress_chunk(self, kind: Compression, chunk: memoryview) -> bytes:
        compressor = self._compressor()
        if kind is Compression.ZSTD:
            return compressor.compress(chunk)
        pairs = _as_array(chunk).reshape(-1, 2)
        high = compressor.compress(np.ascontiguousarray(pairs[:, 1]))
        return b"".join((_PLANE_HEADER.pack(len(high)), high, pairs[:, 0].tobytes()))

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(level=self.level)
            self._local.compressor = compressor
        return compressor

    # --- decoding ------------------------------------------------------------------------------

    def decode_verified(self, items: Sequence[StoredPayload], pool: Executor | None) -> int:
        """Write each item's payload into its dest, in order; return how many leading items
        verified. The first item that fails its checksum ends the run; its dest and those of every
        item after it are zeroed, so no unreported bytes are left behind.

        Raw payloads are copied while `pool` computes the checksums on another core; compressed
        ones are decoded only after their checksum has verified.
        """
        if not items:
            return 0
        groups = [item.chunks for item in items]
        pending = pool.submit(_checksums, groups) if pool is not None else None
        copied = 0
        for item in items:
            if item.record.compression is Compression.NONE:
                _copy_chunks(item.chunks, item.dest)
                copied += item.record.payload_size
        sums = pending.result() if pending is not None else _checksums(groups)
        verified = 0
        decompressed = 0
        started = time.perf_counter()
        for item, actual in zip(items, sums):
            record = item.record
            try:
                if actual != record.checksum:
                    raise zstandard.ZstdError("checksum mismatch")
                if record.compression is not Compression.NONE:
                    self._decode_chunks(record, item.chunks, item.dest)
                    decompressed += record.payload_size
            except zstandard.ZstdError:
                with self._lock:
                    self.counters.verify_failures += 1
                for unreported in items[verified:]:
                    _as_array(unreported.dest[: unreported.record.payload_size]).fill(0)
                break
            verified += 1
        with self._lock:
            c = self.counters
            c.copied_bytes += copied
            c.decompress_out_bytes += decompressed
            c.decompress_s += (time.perf_counter() - started) if decompressed else 0.0
            c.verified_bytes += sum(item.record.payload_size for item in items[:verified])
        return verified

    def _decode_chunks(self, record: BlockRecord, chunks: Sequence[memoryview], dest: memoryview) -> None:
        step = record.chunk_bytes
        size = record.payload_size
        decompressor = self._decompressor()
        for index, chunk in enumerate(chunks):
            start = index * step
            target = dest[start : min(start + step, size)]
            if record.compression is Compression.ZSTD:
                _zstd_into(decompressor, chunk, target)
            else:
                (high_len,) = _PLANE_HEADER.unpack_from(chunk, 0)
                half = target.nbytes // 2
                high = self._scratch(half)
                _zstd_into(decompressor, chunk[4 : 4 + high_len], high)
                pairs = _as_array(target).reshape(-1, 2)
                pairs[:, 1] = _as_array(high)
                pairs[:, 0] = _as_array(chunk[4 + high_len : 4 + high_len + half])

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = zstandard.ZstdDecompressor()
            self._local.decompressor = decompressor
        return decompressor

    def _scratch(self, size: int) -> memoryview:
        """A per-thread buffer reused across blocks, so the hot path allocates no fresh memory."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None or len(buffer) < size:
            buffer = bytearray(max(size, self.chunk_bytes // 2))
            self._local.scratch = buffer
        return memoryview(buffer)[:size]


def _copy_chunks(chunks: Sequence[memoryview], dest: memoryview) -> None:
    """Copy chunk views back to back into dest; numpy's copy releases the GIL."""
    offset = 0
    for chunk in chunks:
        size = chunk.nbytes
        np.copyto(_as_array(dest[offset : offset + size]), _as_array(chunk))
        offset += size


def _zstd_into(decompressor: zstandard.ZstdDecompressor, frame: memoryview, target: memoryview) -> None:
    reader = decompressor.stream_reader(frame)
    filled = 0
    total = target.nbytes
    while filled < total:
        got = reader.readinto(target[filled:])
        if not got:
            break
        filled += got
    if filled != total or reader.read(1):
        raise zstandard.ZstdError(f"frame decodes to a different size than the {total} bytes expected")
