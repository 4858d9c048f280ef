"""Bytes <-> stored chunks: compression and checksums, with no knowledge of LMDB.

Each chunk is compressed on its own, so it decodes straight into its place in the destination. The
crc32c covers the stored bytes of all chunks and is verified before a block is reported; raw
payloads are copied and checksummed piece by piece while each piece is still in cache."""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeGuard, TypeVar

import crc32c
import numpy as np
import zstandard

from prefixd.errors import PayloadError, PrefixdError
from prefixd.schema.records import BlockRecord, Compression, PartRecord
from prefixd.store.direct import FileSpans
from prefixd.store.fair import FairPool

_PLANE_HEADER = struct.Struct("<I")
_PIECE = 256 << 10  # copy-then-checksum granularity: the piece is still in L2 when it is hashed
# preadv-then-checksum granularity: one system call (two GIL round trips) per MiB costs a quarter
# of what 256 KiB pieces cost, with every load's threads contending for the GIL between them, and
# the piece is still in L2 or L3 when it is hashed
_READ_PIECE = 1 << 20
# the least bytes of a load one thread of the FairPool decodes at a time: whole blocks, enough of
# them that handing the piece over costs little beside decoding it
PIECE_BYTES = 1 << 20
# A put's raw payloads are only chunked and checksummed (crc32c, 10+ GB/s), which a second thread
# speeds up only once there is more of it than handing work over costs (waking an idle thread
# takes 50-100 us on a VM whose idle vCPUs halt): puts of 64 raw blocks of 16 KiB ran 5-23 % faster
# with all their encoding in the put's own thread (bench/encode_pool.py). Compression costs far
# more per byte and always takes the pool.
POOL_MIN_RAW_BYTES = 4 << 20
# chunks of a load at most this far apart in the data file are read ahead as one range
READ_AHEAD_GAP = 256 << 10

Buffer = bytes | bytearray | memoryview
PayloadRecord = BlockRecord | PartRecord  # both name a payload's compression, sizes and checksum
# Where a payload that failed verification failed: in its stored bytes (damage: quarantined), only
# in its destination (a client writing into its own region), or the data file could not be read
# where it lies (cut short, or an I/O error: a miss, never quarantined, since removing the block
# would make LMDB read those very pages through its map)
Failure = Literal["stored", "destination", "unreadable"]
_C = TypeVar("_C")


@dataclass(frozen=True, slots=True)
class EncodedPayload:
    """A payload as it will be stored. A large raw put's checksums are taken on the pool while its
    transaction copies the payloads into LMDB (`taken` is then a future), so the put reads them
    only when it compares them with the stored bytes', just before it commits."""

    compression: Compression
    chunks: Sequence[Buffer]
    chunk_bytes: int
    payload_size: int
    stored_size: int
    taken: int | Future[int]

    @property
    def checksum(self) -> int:
        taken = self.taken
        return taken if isinstance(taken, int) else taken.result()


def settle(payloads: Sequence[EncodedPayload]) -> None:
    """Cancel the checksums not started and wait for the one being taken, so no pool thread reads
    a payload once its put has returned (its region slot may be reused)."""
    for payload in payloads:
        taken = payload.taken
        if not isinstance(taken, int) and not taken.cancel():
            taken.exception()


@dataclass(frozen=True, slots=True)
class StoredPayload:
    """One block to decode; its chunk views are valid only inside the read transaction. With
    `source`, a raw payload is read from the file there."""

    record: PayloadRecord
    chunks: list[memoryview]
    dest: memoryview
    source: FileSpans | None = None


@dataclass
class CodecCounters:
    compress_in_bytes: int = 0
    compress_s: float = 0.0
    stored_raw_after_trial: int = 0
    decompress_out_bytes: int = 0
    decompress_s: float = 0.0
    copied_bytes: int = 0
    copy_s: float = 0.0  # verified copies of payloads stored raw (copy and crc32c in one pass)
    file_read_bytes: int = 0  # of copied_bytes, those read from the data file (preadv)
    deadline_cutoffs: int = 0  # loads that stopped reading at their deadline (a shorter hit)
    verify_failures: int = 0
    destinations_changed: int = 0


class Deadline:
    """When a load stops reading (a clock's monotonic seconds). Notes the item where decoding
    stopped, so a cut-off (a correct, shorter hit) is told from a failure. Thread-safe."""

    def __init__(self, monotonic: Callable[[], float], at: float) -> None:
        self._monotonic = monotonic
        self.at = at
        self._lock = threading.Lock()
        self._stopped: list[StoredPayload] = []

    def passed(self) -> bool:
        return self._monotonic() >= self.at

    def stop(self, item: StoredPayload) -> None:
        with self._lock:
            self._stopped.append(item)

    def stopped_at(self, item: StoredPayload) -> bool:
        with self._lock:
            return any(stopped is item for stopped in self._stopped)


class _DeadlinePassed(Exception):
    """Raised between the pieces of a read once its deadline has passed."""


def checksum(chunks: Sequence[Buffer]) -> int:
    value = 0
    for chunk in chunks:
        value = crc32c.crc32c(chunk, value)
    return value


def chunks_present(chunks: list[_C | None]) -> TypeGuard[list[_C]]:
    return all(c is not None for c in chunks)


def _as_array(buffer: Buffer) -> np.ndarray:
    return np.frombuffer(buffer, dtype=np.uint8)


class PayloadCodec:
    def __init__(self, compression: str, *, level: int, min_gain: float, chunk_bytes: int) -> None:
        self.compression = Compression[compression.upper().replace("-", "_")]  # "zstd-planes"
        self.level = level
        self.min_gain = min_gain
        self.chunk_bytes = chunk_bytes
        self.counters = CodecCounters()
        self._lock = threading.Lock()
        self._local = threading.local()

    def encode(self, payload: memoryview) -> EncodedPayload:
        """Chunk, maybe compress, and checksum a payload. Compression saving less than `min_gain` is
        dropped: stored raw, the payload loads at copy speed."""
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
                self.counters.compress_s += time.perf_counter() - started
            if stored <= size * (1.0 - self.min_gain):
                return EncodedPayload(kind, packed, step, size, stored, checksum(packed))
            with self._lock:
                self.counters.stored_raw_after_trial += 1
        return EncodedPayload(Compression.NONE, raw, step, size, size, checksum(raw))

    def encode_many(
        self, payloads: Sequence[memoryview], pool: Executor | None
    ) -> list[EncodedPayload]:
        """`encode` each payload; with a pool, once there is enough to pay for the hand-off (crc32c,
        zstd and numpy release the GIL): the second half (by bytes) compressed on another core, or
        every raw payload's checksum taken there while the caller goes on (`settle` them)."""
        sizes = [p.nbytes for p in payloads]
        if self.compression is Compression.NONE:
            if pool is None or sum(sizes) < POOL_MIN_RAW_BYTES:
                return [self.encode(p) for p in payloads]
            return self._checksummed_aside(payloads, pool)
        split = _halfway(sizes) if pool is not None else len(payloads)
        if pool is None or split >= len(payloads):
            return [self.encode(p) for p in payloads]
        tail = pool.submit(lambda: [self.encode(p) for p in payloads[split:]])
        head = [self.encode(p) for p in payloads[:split]]
        return head + tail.result()

    def _checksummed_aside(
        self, payloads: Sequence[memoryview], pool: Executor
    ) -> list[EncodedPayload]:
        step = self.chunk_bytes
        encoded = [
            EncodedPayload(
                Compression.NONE,
                [p[off : off + step] for off in range(0, p.nbytes, step)],
                step,
                p.nbytes,
                p.nbytes,
                Future(),
            )
            for p in payloads
        ]

        def take() -> None:
            for payload in encoded:
                future = payload.taken
                assert isinstance(future, Future)
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(checksum(payload.chunks))
                    except Exception as error:  # noqa: BLE001 - the put raises it as it compares
                        future.set_exception(error)

        pool.submit(take)
        return encoded

    def _compress_chunk(self, kind: Compression, chunk: memoryview) -> bytes:
        compressor = self._compressor()
        if kind is Compression.ZSTD:
            return compressor.compress(chunk)
        pairs = _as_array(chunk).reshape(-1, 2)
        high = compressor.compress(np.ascontiguousarray(pairs[:, 1]).data)
        return b"".join((_PLANE_HEADER.pack(len(high)), high, pairs[:, 0].tobytes()))

    def _compressor(self) -> zstandard.ZstdCompressor:
        compressor = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(level=self.level)
            self._local.compressor = compressor
        return compressor

    def decode_verified(
        self,
        items: Sequence[StoredPayload],
        pool: FairPool | None,
        deadline: Deadline | None = None,
    ) -> int:
        """Write each item's payload into its dest, in order; return how many leading items
        verified. The dests of the first failing item and all after it are zeroed, so no unreported
        bytes are left behind; past `deadline` decoding stops there too.

        With a pool, pieces of whole blocks (PIECE_BYTES or more) are decoded beside every other
        load's, a piece of each in turn (prefixd.store.fair)."""
        if not items:
            return 0
        _read_ahead(items)
        runs = _pieces(items) if pool is not None else [(0, len(items))]
        if pool is None or len(runs) == 1:
            verified = self._decode_run(items, deadline)
        else:
            done = [0] * len(runs)

            def piece(index: int) -> bool:
                start, end = runs[index]
                done[index] = self._decode_run(items[start:end], deadline)
                return done[index] == end - start

            pool.run([partial(piece, index) for index in range(len(runs))])
            verified = 0
            for (start, end), count in zip(runs, done):
                verified += count
                if count < end - start:
                    break
        if verified < len(items):
            cut = deadline is not None and deadline.stopped_at(items[verified])
            with self._lock:
                if cut:
                    self.counters.deadline_cutoffs += 1
                else:
                    self.counters.verify_failures += 1
            for unreported in items[verified:]:
                _as_array(unreported.dest[: unreported.record.payload_size]).fill(0)
        return verified

    def failure(self, item: StoredPayload) -> Failure:
        """Where an item that failed `decode_verified` failed. A raw payload is checksummed in its
        destination, so a client writing into its own region fails the check with the stored bytes
        intact: those are checked again here (a payload from the file is read again into scratch
        memory, never through the map, where a file cut short would fault)."""
        record = item.record
        if record.compression is not Compression.NONE:
            return "stored"
        if item.source is not None:
            stored = self._file_checksum(item.source, [c.nbytes for c in item.chunks])
            if stored is None:
                return "unreadable"
        else:
            stored = checksum(item.chunks)
        if stored != record.checksum:
            return "stored"
        with self._lock:
            self.counters.destinations_changed += 1
        return "destination"

    def _decode_run(self, items: Sequence[StoredPayload], deadline: Deadline | None) -> int:
        """Decode items in order; return how many did before one failed or the deadline hit."""
        copied = decompressed = from_file = 0
        started = time.perf_counter()
        done = 0
        for item in items:
            record = item.record
            if deadline is not None and deadline.passed():
                deadline.stop(item)
                break
            if record.compression is Compression.NONE:
                if item.source is not None:
                    try:
                        value = _read_and_checksum(item.source, item.chunks, item.dest, deadline)
                    except _DeadlinePassed:
                        assert deadline is not None
                        deadline.stop(item)
                        break
                    from_file += record.payload_size
                else:
                    value = _copy_and_checksum(item.chunks, item.dest)
                if value != record.checksum:
                    break
                copied += record.payload_size
            else:
                if checksum(item.chunks) != record.checksum:
                    break
                try:
                    self._decode_chunks(record, item.chunks, item.dest)
                except zstandard.ZstdError:
                    break
                decompressed += record.payload_size
            done += 1
        elapsed = time.perf_counter() - started
        with self._lock:
            c = self.counters
            c.copied_bytes += copied
            c.file_read_bytes += from_file
            c.decompress_out_bytes += decompressed
            if decompressed:
                c.decompress_s += elapsed * decompressed / (decompressed + copied)
            if copied:
                c.copy_s += elapsed * copied / (decompressed + copied)
        return done

    def _decode_chunks(
        self, record: PayloadRecord, chunks: Sequence[memoryview], dest: memoryview
    ) -> None:
        step = record.chunk_bytes
        size = record.payload_size
        decompressor = self._decompressor()
        for index, chunk in enumerate(chunks):
            start = index * step
            target = dest[start : min(start + step, size)]
            if record.compression is Compression.ZSTD:
                _zstd_into(decompressor, chunk, target)
                continue
            (high_len,) = _PLANE_HEADER.unpack_from(chunk, 0)
            half = target.nbytes // 2
            high = self._scratch(half)
            _zstd_into(decompressor, chunk[4 : 4 + high_len], high)
            low = _as_array(chunk[4 + high_len : 4 + high_len + half])
            # little-endian 2-byte values: value = high << 8 | low, built in place in the dest
            values = np.frombuffer(target, dtype="<u2")
            np.left_shift(_as_array(high), 8, out=values, dtype=np.uint16)
            np.bitwise_or(values, low, out=values, dtype=np.uint16)

    def _file_checksum(self, source: FileSpans, sizes: Sequence[int]) -> int | None:
        scratch = self._scratch(_READ_PIECE)
        value = 0
        for at, size in zip(source.offsets, sizes):
            for start in range(0, size, _READ_PIECE):
                piece = scratch[: min(_READ_PIECE, size - start)]
                if not _pread_exactly(source.fd, piece, at + start):
                    return None
                value = crc32c.crc32c(piece, value)
        return value

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        decompressor = getattr(self._local, "decompressor", None)
        if decompressor is None:
            decompressor = zstandard.ZstdDecompressor()
            self._local.decompressor = decompressor
        return decompressor

    def _scratch(self, size: int) -> memoryview:
        """A per-thread buffer reused across blocks: the hot path allocates nothing."""
        buffer = getattr(self._local, "scratch", None)
        if buffer is None or len(buffer) < size:
            buffer = bytearray(max(size, self.chunk_bytes // 2))
            self._local.scratch = buffer
        return memoryview(buffer)[:size]


def _pieces(items: Sequence[StoredPayload]) -> list[tuple[int, int]]:
    """[start, end) runs of at least PIECE_BYTES each; a small last run joins the one before."""
    runs: list[tuple[int, int]] = []
    start = size = 0
    for index, item in enumerate(items):
        size += item.record.payload_size
        if size >= PIECE_BYTES:
            runs.append((start, index + 1))
            start, size = index + 1, 0
    if start < len(items):
        if runs and size < PIECE_BYTES // 2:
            runs[-1] = (runs[-1][0], len(items))
        else:
            runs.append((start, len(items)))
    return runs


def _halfway(sizes: Sequence[int]) -> int:
    total = sum(sizes)
    running = 0
    for index, size in enumerate(sizes):
        running += size
        if running * 2 >= total:
            return index + 1
    return len(sizes)


def _copy_and_checksum(chunks: Sequence[memoryview], dest: memoryview) -> int:
    """Copy chunk views back to back into dest in cache-sized pieces, taking the crc32c of each
    piece while it is still in cache."""
    value = 0
    offset = 0
    for chunk in chunks:
        for start in range(0, chunk.nbytes, _PIECE):
            piece = chunk[start : start + _PIECE]
            target = dest[offset : offset + piece.nbytes]
            np.copyto(_as_array(target), _as_array(piece))
            value = crc32c.crc32c(target, value)
            offset += piece.nbytes
    return value


def _read_and_checksum(
    source: FileSpans,
    chunks: Sequence[memoryview],
    dest: memoryview,
    deadline: Deadline | None = None,
) -> int | None:
    """`_copy_and_checksum`, reading each chunk from `source` with preadv. None if the file cannot
    be read or ends early; _DeadlinePassed between two pieces once `deadline` passed (a stalled
    read)."""
    value = 0
    offset = 0
    for at, chunk in zip(source.offsets, chunks):
        for start in range(0, chunk.nbytes, _READ_PIECE):
            if offset and deadline is not None and deadline.passed():
                raise _DeadlinePassed
            target = dest[offset : offset + min(_READ_PIECE, chunk.nbytes - start)]
            if not _pread_exactly(source.fd, target, at + start):
                return None
            value = crc32c.crc32c(target, value)
            offset += target.nbytes
    return value


def _read_ahead(items: Sequence[StoredPayload]) -> None:
    """Ask the kernel for every chunk a load will read from the file at once, so a cold cache serves
    the whole load at its queue depth (a chain's blocks need not lie together, so readahead alone
    misses them). Close chunks are asked for as one range: each call costs about 20 us even on a
    warm cache."""
    spans: dict[int, list[tuple[int, int]]] = {}
    for item in items:
        source = item.source
        if source is None:
            continue
        wanted = spans.setdefault(source.fd, [])
        wanted.extend((at, chunk.nbytes) for at, chunk in zip(source.offsets, item.chunks))
    for fd, wanted in spans.items():
        for at, length in read_ahead_ranges(wanted):
            try:
                os.posix_fadvise(fd, at, length, os.POSIX_FADV_WILLNEED)
            except OSError:
                return  # a hint only: the reads themselves report what is wrong


def read_ahead_ranges(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) ranges covering `spans` in file order, merging those at most READ_AHEAD_GAP
    apart."""
    merged: list[list[int]] = []  # [start, end)
    for at, length in sorted(spans):
        if merged and at <= merged[-1][1] + READ_AHEAD_GAP:
            merged[-1][1] = max(merged[-1][1], at + length)
        else:
            merged.append([at, at + length])
    return [(start, end - start) for start, end in merged]


def _pread_exactly(fd: int, target: memoryview, at: int) -> bool:
    """Fill `target` from `fd` at `at`; False on an error or the end of the file."""
    filled = 0
    while filled < target.nbytes:
        try:
            got = os.preadv(fd, [target[filled:]], at + filled)
        except OSError:
            return False
        if got <= 0:
            return False
        filled += got
    return True


def _zstd_into(
    decompressor: zstandard.ZstdDecompressor, frame: memoryview, target: memoryview
) -> None:
    reader = decompressor.stream_reader(frame)
    filled = 0
    total = target.nbytes
    while filled < total:
        got = reader.readinto(target[filled:])
        if not got:
            break
        filled += got
    if filled != total or reader.read(1):
        raise zstandard.ZstdError(
            f"frame decodes to a different size than the {total} bytes expected"
        )


def byte_view(
    buffer: Any, what: str, error: type[PrefixdError], *, writable: bool = False
) -> memoryview:
    """`buffer` as a flat byte view, or `error` naming `what` (a caller's mistake, said plainly)."""
    try:
        view = memoryview(buffer)
    except TypeError:
        raise error(f"{what} is a {type(buffer).__name__}, not a byte buffer") from None
    if writable and view.readonly:
        raise error(f"{what} is read-only")
    if not view.c_contiguous:
        raise error(f"{what} is not contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def payload_view(payload: Any, what: str) -> memoryview:
    """A put's payload as a flat, non-empty byte view, or PayloadError naming `what`."""
    view = byte_view(payload, what, PayloadError)
    if view.nbytes == 0:
        raise PayloadError(f"{what} is empty")
    return view
