"""The codec on its own: round trips, the raw fallback, and checksum enforcement."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixd.schema.records import BlockRecord, Compression
from prefixd.store.codec import (
    POOL_MIN_RAW_BYTES,
    PayloadCodec,
    StoredPayload,
    checksum,
    settle,
)
from prefixd.store.fair import FairPool

CHUNK = 64 << 10
POOL = FairPool(2)


def codec(kind: str, min_gain: float = 0.05) -> PayloadCodec:
    return PayloadCodec(kind, level=1, min_gain=min_gain, chunk_bytes=CHUNK)


def stored(encoded, dest: memoryview) -> StoredPayload:  # type: ignore[no-untyped-def]
    record = BlockRecord(
        encoded.compression,
        encoded.chunk_bytes,
        len(encoded.chunks),
        encoded.checksum,
        encoded.payload_size,
        encoded.stored_size,
        0,
        bytes(16),
        bytes(16),
        bytes(16),
    )
    return StoredPayload(record, [memoryview(bytes(c)) for c in encoded.chunks], dest)


def bf16_like(n: int, seed: int = 0) -> bytes:
    """High bytes of float32 normals: the exponent plane compresses, the mantissa plane does not."""
    values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    return values.view(np.uint16)[1::2].tobytes()


payload_bytes = st.one_of(
    st.binary(min_size=1, max_size=3 * CHUNK + 7),
    st.builds(lambda n, b: bytes([b]) * n, st.integers(1, 3 * CHUNK + 3), st.integers(0, 255)),
    st.builds(bf16_like, st.integers(1, 100_000), st.integers(0, 5)),
)


@settings(max_examples=60, deadline=None)
@given(payload_bytes, st.sampled_from(["none", "zstd", "zstd-planes"]))
def test_round_trip(data: bytes, kind: str) -> None:
    c = codec(kind)
    encoded = c.encode(memoryview(data))
    assert encoded.payload_size == len(data)
    assert encoded.stored_size == sum(len(x) for x in encoded.chunks)
    assert encoded.checksum == checksum(encoded.chunks)
    if encoded.compression is not Compression.NONE:
        assert encoded.stored_size <= len(data) * 0.95
    dest = bytearray(len(data))
    for pool in (None, POOL):
        assert c.decode_verified([stored(encoded, memoryview(dest))], pool) == 1
        assert bytes(dest) == data


def test_incompressible_payload_is_stored_raw() -> None:
    data = np.random.default_rng(1).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
    c = codec("zstd")
    encoded = c.encode(memoryview(data))
    assert encoded.compression is Compression.NONE and encoded.stored_size == len(data)
    assert c.counters.stored_raw_after_trial == 1


def test_planes_beat_plain_zstd_on_bf16() -> None:
    data = bf16_like(200_000)
    plain = codec("zstd", min_gain=0.0).encode(memoryview(data))
    planes = codec("zstd-planes", min_gain=0.0).encode(memoryview(data))
    assert planes.compression is Compression.ZSTD_PLANES
    assert planes.stored_size < plain.stored_size


def test_odd_length_planes_fall_back_to_zstd() -> None:
    data = b"abc" * 1001
    encoded = codec("zstd-planes").encode(memoryview(data))
    assert encoded.compression is Compression.ZSTD


@pytest.mark.parametrize("kind", ["none", "zstd", "zstd-planes"])
@given(position=st.integers(0, 10**9), bit=st.integers(0, 7))
@settings(max_examples=25, deadline=None)
def test_any_flipped_bit_is_caught(kind: str, position: int, bit: int) -> None:
    data = bf16_like(150_000, seed=3) if kind != "none" else bytes(range(256)) * 600
    c = codec(kind, min_gain=0.0)
    encoded = c.encode(memoryview(data))
    item = stored(encoded, memoryview(bytearray(len(data))))
    chunk_index = position % len(item.chunks)
    damaged = bytearray(item.chunks[chunk_index])
    damaged[position % len(damaged)] ^= 1 << bit
    item.chunks[chunk_index] = memoryview(bytes(damaged))
    assert c.decode_verified([item], POOL) == 0
    assert not any(item.dest)  # nothing unverified is left in the destination


def test_run_stops_at_the_first_bad_payload() -> None:
    c = codec("none")
    datas = [bytes([i]) * 5000 for i in range(1, 5)]
    dests = [bytearray(5000) for _ in datas]
    items = [stored(c.encode(memoryview(d)), memoryview(o)) for d, o in zip(datas, dests)]
    items[2].chunks[0] = memoryview(b"\x00" * 5000)
    assert c.decode_verified(items, POOL) == 2
    assert bytes(dests[1]) == datas[1]
    assert not any(dests[2]) and not any(dests[3])  # nothing unreported is left behind
    assert c.counters.verify_failures == 1


class _CountingPool(ThreadPoolExecutor):
    """A pool that counts the work handed to it."""

    def __init__(self) -> None:
        super().__init__(1)
        self.submitted = 0

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        self.submitted += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize(
    ("kind", "count", "size", "handed_over"),
    [
        ("none", 64, 16 << 10, False),  # 1 MiB to checksum: cheaper here than a hand-off
        ("none", 2, POOL_MIN_RAW_BYTES // 2, True),
        ("zstd", 2, 16 << 10, True),  # compression always pays for a second thread
        ("none", 1, POOL_MIN_RAW_BYTES, True),  # taken aside while the transaction copies it
    ],
)
def test_encode_many_hands_work_to_the_pool_only_when_it_pays(
    kind: str, count: int, size: int, handed_over: bool
) -> None:
    c = codec(kind)
    payloads = [memoryview(bf16_like(size // 2, seed)) for seed in range(count)]
    with _CountingPool() as pool:
        encoded = c.encode_many(payloads, pool)
    assert (pool.submitted > 0) is handed_over
    assert [e.payload_size for e in encoded] == [p.nbytes for p in payloads]
    assert [e.checksum for e in encoded] == [c.encode(p).checksum for p in payloads]


def test_settle_cancels_the_checksums_not_started_so_no_thread_reads_a_payload_after_its_put() -> (
    None
):
    """A put that ends early (refused, or the map full) settles its payloads: the checksums still
    queued are cancelled, so the pool never reads a region slot the client may reuse."""
    c = codec("none")
    payloads = [memoryview(bf16_like(POOL_MIN_RAW_BYTES // 4, seed)) for seed in range(2)]
    gate = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        pool.submit(gate.wait)  # the pool is busy: the checksums wait behind it
        encoded = c.encode_many(payloads, pool)
        settle(encoded)
        gate.set()
    assert all(isinstance(e.taken, Future) and e.taken.cancelled() for e in encoded)
