"""Store semantics: put refusals, idempotence, longest prefix, collisions, reads and stats."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import lmdb
import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.errors import (
    BlockCollisionError,
    DestinationError,
    OpenTailError,
    OrphanBlockError,
    PayloadError,
    StoreClosedError,
    TokenError,
)
from prefixd.schema.records import BlockRecord

TOKENS = list(range(100, 120))  # five closed blocks of 4


def payloads(n: int, size: int = 1000, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size + i, dtype=np.uint8).tobytes() for i in range(n)]


def test_put_then_load_returns_identical_bytes(store: Store, identity: Identity) -> None:
    data = payloads(5)
    result = store.put(identity, TOKENS, data)
    assert (result.stored, result.existed, len(result.hashes)) == (5, 0, 5)
    out = bytearray(sum(map(len, data)))
    loaded = store.load(identity, TOKENS, out)
    assert (loaded.n_blocks, loaded.n_tokens) == (5, 20)
    for offset, size, expected in zip(loaded.offsets, loaded.sizes, data):
        assert bytes(out[offset : offset + size]) == expected


def test_read_into_separate_destinations(store: Store, identity: Identity) -> None:
    data = payloads(3)
    store.put(identity, TOKENS, data)
    match = store.longest_prefix(identity, TOKENS)
    assert match.n_blocks == 3 and match.payload_bytes == sum(map(len, data))
    dests = [np.zeros(len(d) + 7, dtype=np.uint8) for d in data]
    result = store.read_into(match, dests)
    assert result.n_blocks == 3 and result.sizes == tuple(map(len, data))
    for dest, expected in zip(dests, data):
        assert dest[: len(expected)].tobytes() == expected


def test_open_tail_is_refused(store: Store, identity: Identity) -> None:
    with pytest.raises(OpenTailError, match="only closed blocks"):
        store.put(identity, TOKENS[:7], payloads(2))
    assert store.longest_prefix(identity, TOKENS).n_blocks == 0
    assert store.stats().blocks == 0


def test_orphan_is_refused_and_nothing_is_written(store: Store, identity: Identity) -> None:
    with pytest.raises(OrphanBlockError):
        store.put(identity, TOKENS, payloads(2), first_block=1)
    assert store.stats().blocks == 0
    store.put(identity, TOKENS, payloads(1))
    with pytest.raises(OrphanBlockError):
        store.put(identity, TOKENS, payloads(1), first_block=2)
    store.put(identity, TOKENS, payloads(2)[1:], first_block=1)
    assert store.longest_prefix(identity, TOKENS).n_blocks == 2


def test_parent_in_the_same_put_is_accepted(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(4))
    assert store.longest_prefix(identity, TOKENS).n_blocks == 4


def test_put_of_existing_blocks_is_a_noop_that_reports_it(store: Store, identity: Identity) -> None:
    first = payloads(3, seed=1)
    store.put(identity, TOKENS, first)
    again = store.put(identity, TOKENS, payloads(4, seed=2))
    assert (again.stored, again.existed) == (1, 3)
    out = bytearray(10_000)
    loaded = store.load(identity, TOKENS, out)
    # one owner: the first writer's payloads stay
    assert bytes(out[: loaded.sizes[0]]) == first[0]
    assert store.stats().blocks == 4


def test_longest_prefix_stops_at_the_first_missing_block(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(4))
    match = store.longest_prefix(identity, TOKENS)
    assert store.delete([match.blocks[1].hash]) == 3  # block 1 and its descendants
    assert store.longest_prefix(identity, TOKENS).n_blocks == 1
    assert store.check() == []


def test_divergent_prompts_share_only_their_common_blocks(store: Store, identity: Identity) -> None:
    other = TOKENS[:8] + [9, 9, 9, 9]
    store.put(identity, TOKENS, payloads(3))
    assert store.longest_prefix(identity, other).n_blocks == 2
    store.put(identity, other, payloads(1, seed=7), first_block=2)
    assert store.longest_prefix(identity, other).n_blocks == 3
    assert store.longest_prefix(identity, TOKENS).n_blocks == 3
    assert store.stats().blocks == 4


def test_identities_never_share(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(2))
    for field, value in [
        ("tenant", "b"),
        ("weights", "w2"),
        ("adapter", "lora@1"),
        ("kv_layout", "fp8"),
    ]:
        other = Identity(**{**identity.to_dict(), field: value})
        assert store.longest_prefix(other, TOKENS).n_blocks == 0
        assert store.load(other, TOKENS, bytearray(10_000)).n_blocks == 0


def test_injected_hash_collision_is_a_miss_and_counted(tmp_path: Path, identity: Identity) -> None:
    """Rewrite block 1's record so its hash appears to own other tokens."""
    path = tmp_path / "s"
    with Store.open(path) as store:
        store.put(identity, TOKENS, payloads(3))
        target = store.longest_prefix(identity, TOKENS).blocks[1].hash
    env = lmdb.open(str(path), max_dbs=16)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True, db=blocks) as txn:
        record = BlockRecord.decode(txn.get(target))
        forged = np.frombuffer(record.tokens, dtype="<u4") + 1
        txn.put(target, BlockRecord(**{**_fields(record), "tokens": forged.tobytes()}).encode())
    env.close()
    with Store.open(path) as store:
        assert store.longest_prefix(identity, TOKENS).n_blocks == 1
        assert store.load(identity, TOKENS, bytearray(10_000)).n_blocks == 1
        assert store.stats().collisions == 2
        # the colliding owner keeps its hash; a put through it is refused, never overwritten
        with pytest.raises(BlockCollisionError):
            store.put(identity, TOKENS, payloads(3))
        assert store.stats().collisions == 3
    with Store.open(path) as store:
        assert store.stats().collisions == 3  # persisted


def _fields(record: BlockRecord) -> dict[str, object]:
    return {name: getattr(record, name) for name in BlockRecord._fields}


def test_bad_payloads_and_destinations(store: Store, identity: Identity) -> None:
    with pytest.raises(PayloadError, match="empty"):
        store.put(identity, TOKENS, [b"x", b""])
    with pytest.raises(PayloadError, match="not a byte buffer"):
        store.put(identity, TOKENS, ["text"])
    with pytest.raises(PayloadError, match="not contiguous"):
        store.put(identity, TOKENS, [np.zeros((4, 4), dtype=np.uint8)[:, 1]])
    with pytest.raises(PayloadError, match="first_block"):
        store.put(identity, TOKENS, [b"x"], first_block=-1)
    with pytest.raises(TokenError):
        store.put(identity, [-1, 2, 3, 4], [b"x"])
    store.put(identity, TOKENS, [b"abcd"])
    match = store.longest_prefix(identity, TOKENS)
    with pytest.raises(DestinationError, match="read-only"):
        store.read_into(match, [b"    "])
    with pytest.raises(DestinationError, match="holds 2 bytes"):
        store.read_into(match, [bytearray(2)])
    with pytest.raises(DestinationError, match="destinations"):
        store.read_into(match, [])
    assert store.stats().blocks == 1


def test_load_stops_where_the_buffer_ends(store: Store, identity: Identity) -> None:
    data = payloads(3, size=100)
    store.put(identity, TOKENS, data)
    loaded = store.load(identity, TOKENS, bytearray(205))
    assert loaded.n_blocks == 2 and loaded.n_tokens == 8
    assert store.load(identity, TOKENS, bytearray(10_000), max_blocks=1).n_blocks == 1


def test_typed_payload_buffers(store: Store, identity: Identity) -> None:
    tensor_like = np.arange(1024, dtype=np.float16).reshape(32, 32)
    store.put(identity, TOKENS, [tensor_like])
    out = np.zeros((32, 32), dtype=np.float16)
    assert store.load(identity, TOKENS, out).n_blocks == 1
    assert np.array_equal(out, tensor_like)


def test_large_payloads_are_split_into_chunks(tmp_path: Path, identity: Identity) -> None:
    with Store.open(tmp_path / "s", chunk_bytes=64 << 10) as store:
        data = payloads(2, size=300_000)
        store.put(identity, TOKENS, data)
        out = bytearray(700_000)
        loaded = store.load(identity, TOKENS, out)
        assert loaded.n_blocks == 2
        assert bytes(out[loaded.offsets[1] : loaded.offsets[1] + loaded.sizes[1]]) == data[1]
        assert store.check() == []


def test_block_info_and_access_times(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(1, size=64))
    block = store.longest_prefix(identity, TOKENS).blocks[0].hash
    info = store.block_info(block)
    assert info is not None
    assert (info.n_tokens, info.payload_size, info.compression) == (4, 64, "none")
    assert info.identity_digest == identity.digest and info.last_access_ns >= info.created_ns
    before = info.last_access_ns
    store.load(identity, TOKENS, bytearray(64))
    store.sync()
    after = store.block_info(block)
    assert after is not None and after.last_access_ns > before
    assert after.hits == 2  # the lookup and the load; a put is not a hit
    store.load(identity, TOKENS, bytearray(64))
    store.sync()
    again = store.block_info(block)
    assert again is not None and again.hits == 3
    assert store.block_info(b"\x01" * 16) is None


def test_persistence_across_reopen(tmp_path: Path, identity: Identity) -> None:
    data = payloads(5)
    with Store.open(tmp_path / "s") as store:
        store.put(identity, TOKENS, data)
    with Store.open(tmp_path / "s", create=False) as store:
        out = bytearray(10_000)
        loaded = store.load(identity, TOKENS, out)
        assert loaded.n_blocks == 5
        assert bytes(out[loaded.offsets[4] : loaded.offsets[4] + loaded.sizes[4]]) == data[4]
        stats = store.stats()
        assert (stats.blocks, stats.payload_bytes, stats.identities) == (5, sum(map(len, data)), 1)


def test_full_durability_mode(tmp_path: Path, identity: Identity) -> None:
    with Store.open(tmp_path / "s", durability="full") as store:
        store.put(identity, TOKENS, payloads(2))
        assert store.longest_prefix(identity, TOKENS).n_blocks == 2


def test_closed_store_refuses_calls(tmp_path: Path, identity: Identity) -> None:
    store = Store.open(tmp_path / "s")
    store.close()
    store.close()
    with pytest.raises(StoreClosedError):
        store.longest_prefix(identity, TOKENS)


def test_concurrent_writers_and_readers(store: Store, identity: Identity) -> None:
    """Threads putting overlapping chains and reading them back never see a partial block."""
    errors: list[BaseException] = []
    prompts = [TOKENS[:8] + [t] * 12 for t in range(8)]

    def work(k: int) -> None:
        try:
            for round_ in range(10):
                tokens = prompts[(k + round_) % len(prompts)]
                data = [bytes([tokens[8]]) * 500 for _ in range(5)]
                store.put(identity, tokens, data)
                out = bytearray(2500)
                loaded = store.load(identity, tokens, out)
                assert loaded.n_blocks == 5
                assert bytes(out[1000:1500]) == bytes([tokens[8]]) * 500
        except BaseException as exc:  # surfaced below  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert store.stats().blocks == 2 + 8 * 3
    assert store.check() == []


def test_stats_report_compression(tmp_path: Path, identity: Identity) -> None:
    with Store.open(tmp_path / "s", compression="zstd") as store:
        store.put(identity, TOKENS, [b"abc" * 10_000, os.urandom(30_000)])
        stats = store.stats()
        assert stats.compression_ratio > 1.5
        assert stats.compressed_payloads_stored_raw == 1  # random bytes do not compress
        assert stats.compress_gbps > 0
        store.load(identity, TOKENS, bytearray(100_000))
        assert store.stats().decompress_gbps > 0
        blocks = store.longest_prefix(identity, TOKENS).blocks
        infos = [store.block_info(block.hash) for block in blocks]
        assert [info.compression for info in infos if info] == ["zstd", "none"]


def test_client_supplied_hashes_only_choose_records(tmp_path: Path, identity: Identity) -> None:
    """Precomputed hashes speed a lookup up but cannot make a wrong prefix match."""
    from prefixd.schema.chain import packed_hashes

    store = Store.open(tmp_path / "s", verified_cache_bytes=0)  # walks only
    store.put(identity, TOKENS, payloads(5))
    good = packed_hashes(identity, TOKENS)
    assert store.longest_prefix(identity, TOKENS, hashes=good).n_blocks == 5
    other = TOKENS[:4] + [7] * 16
    # the other prompt's tokens with this prompt's hashes: block 1's tokens differ -> a miss there
    assert store.longest_prefix(identity, other, hashes=good).n_blocks == 1
    assert store.load(identity, other, bytearray(10_000), hashes=good).n_blocks == 1
    swapped = good[16:32] + good[:16] + good[32:]
    assert store.longest_prefix(identity, TOKENS, hashes=swapped).n_blocks == 0
    with pytest.raises(TokenError, match="block hashes"):
        store.longest_prefix(identity, TOKENS, hashes=good[:-1])
    store.close()


def test_write_buffers_are_kept_on_glibc() -> None:
    import platform

    from prefixd.store.allocator import keep_write_buffers

    assert keep_write_buffers() is (platform.libc_ver()[0] == "glibc")
