"""Fault tests: damaged bytes on disk, unreadable stores, a full map, kill -9 and fork.

Damage is done the way a disk would do it: the store is closed, bytes of `data.mdb` are located by
content and flipped, and the store is reopened. LMDB is copy-on-write, so a page may also survive
in a stale copy; every copy of the located bytes is flipped, so whichever one is live is damaged.
"""

from __future__ import annotations

import os
import random
import select
import signal
import struct
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self

import crc32c
import lmdb
import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.clock import ManualClock
from prefixd.errors import (
    CorruptMetaError,
    NotAStoreError,
    PayloadError,
    SchemaVersionError,
    StoreClosedError,
    StoreFullError,
    StoreOpenError,
)
from prefixd.schema.meta import FORMAT_SETTINGS, SCHEMA_VERSION, StoreMeta
from prefixd.schema.records import chunk_key
from prefixd.store import lmdb_errors
from prefixd.store.purge import PurgeSelector

IDENT = Identity(
    model="m",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=4,
    tenant="a",
)
MAP = 32 << 20
N_BLOCKS = 4
BAD = 2  # the damaged block: in the middle of a chain of N_BLOCKS
TOKENS = [0x7A7A0000 + i for i in range(N_BLOCKS * 4)]
SENTINEL = 0xAB


# --- helpers -----------------------------------------------------------------------------------


def open_store(path: Path, **settings: object) -> Store:
    settings.setdefault("map_size", MAP)
    return Store.open(path, **settings)


def random_payloads(n: int, size: int = 16 << 10, seed: int = 1) -> list[bytes]:
    """Distinct random payloads, large enough to live in LMDB overflow pages."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size + 8 * i, dtype=np.uint8).tobytes() for i in range(n)]


def text_payloads(n: int, seed: int = 1) -> list[bytes]:
    """Compressible payloads whose compressed forms differ from block to block."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        head = rng.randbytes(64)
        body = f"block {i} of seed {seed}: the quick brown fox jumps over the lazy dog. ".encode()
        out.append(head + body * 200)
    return out


def flip_in_file(data_file: Path, needle: bytes, at: int) -> int:
    """Flip the byte at offset `at` of every occurrence of `needle` in the file; return how many."""
    assert 0 <= at < len(needle)
    data = bytearray(data_file.read_bytes())
    found = 0
    start = data.find(needle)
    while start >= 0:
        data[start + at] ^= 0x5A
        found += 1
        start = data.find(needle, start + 1)
    assert found >= 1, "the bytes to damage were not found in data.mdb"
    data_file.write_bytes(bytes(data))
    return found


def corrupt_payload(path: Path, payload: bytes) -> None:
    """Flip one byte in the middle of a raw-stored payload, found by a 64-byte slice of it."""
    mid = len(payload) // 2
    flip_in_file(path / "data.mdb", payload[mid - 32 : mid + 32], 32)


def stored_chunk(path: Path, block: bytes, index: int = 0) -> bytes:
    """A block's stored chunk as it lies in LMDB, read with the plain lmdb module."""
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    try:
        chunks = env.open_db(b"chunks", create=False)
        with env.begin() as txn:
            value = txn.get(chunk_key(block, index), db=chunks)
        assert value is not None
        return bytes(value)
    finally:
        env.close()


def corrupt_stored_chunk(path: Path, block: bytes) -> None:
    """Flip a byte in the middle of a block's stored (e.g. compressed) chunk."""
    chunk = stored_chunk(path, block)
    mid = len(chunk) // 2
    lo = max(0, mid - 32)
    flip_in_file(path / "data.mdb", chunk[lo : mid + 32], mid - lo)


def put_chain(path: Path, compression: str) -> tuple[list[bytes], tuple[bytes, ...]]:
    payloads = text_payloads(N_BLOCKS) if compression == "zstd" else random_payloads(N_BLOCKS)
    with open_store(path, compression=compression) as store:
        result = store.put(IDENT, TOKENS, payloads)
        assert result.stored == N_BLOCKS
        for h in result.hashes:
            assert store.block_info(h).compression == compression
        assert store.check() == []
    return payloads, result.hashes


def assert_loads(store: Store, payloads: list[bytes], tokens: list[int] = TOKENS) -> None:
    out = bytearray(sum(map(len, payloads)))
    loaded = store.load(IDENT, tokens, out)
    assert loaded.n_blocks == len(payloads)
    for offset, size, expected in zip(loaded.offsets, loaded.sizes, payloads):
        assert bytes(out[offset : offset + size]) == expected


def dir_snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# --- 1. damaged payload bytes ------------------------------------------------------------------


@pytest.mark.parametrize("reader", ["load", "read_into"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_corrupt_payload_is_a_miss_zeroed_and_quarantined(
    tmp_path: Path, compression: str, reader: str
) -> None:
    path = tmp_path / "s"
    payloads, hashes = put_chain(path, compression)
    if compression == "none":
        corrupt_payload(path, payloads[BAD])
    else:
        chunk = stored_chunk(path, hashes[BAD])
        assert len(chunk) < len(payloads[BAD]) // 2  # really stored compressed
        corrupt_stored_chunk(path, hashes[BAD])

    with open_store(path, compression=compression) as store:
        sizes = [len(p) for p in payloads]
        if reader == "load":
            out = bytearray([SENTINEL]) * sum(sizes)
            loaded = store.load(IDENT, TOKENS, out)
            assert (loaded.n_blocks, loaded.n_tokens) == (BAD, BAD * 4)
            start = sum(sizes[:BAD])
            bad_dest = bytes(out[start : start + sizes[BAD]])
            for i in range(BAD):
                assert bytes(out[loaded.offsets[i] : loaded.offsets[i] + sizes[i]]) == payloads[i]
        else:
            match = store.longest_prefix(IDENT, TOKENS)
            assert match.n_blocks == N_BLOCKS  # records are intact: payloads are not read
            dests = [bytearray([SENTINEL]) * n for n in sizes]
            read = store.read_into(match, dests)
            assert read.n_blocks == BAD
            assert read.sizes == tuple(sizes[:BAD])
            bad_dest = bytes(dests[BAD])
            for i in range(BAD):
                assert bytes(dests[i]) == payloads[i]
        assert bad_dest == bytes(sizes[BAD])  # zeroed: no unverified byte is left there

        stats = store.stats()
        assert stats.quarantined == 1
        assert stats.verify_failures == 1
        assert stats.blocks == BAD  # the block went with its whole subtree
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == BAD
        for h in hashes[BAD:]:
            assert store.block_info(h) is None
        assert store.check() == []

        again = store.put(IDENT, TOKENS, payloads[BAD:], first_block=BAD)
        assert (again.stored, again.existed) == (N_BLOCKS - BAD, 0)
        assert_loads(store, payloads)
        assert store.check() == []
        assert store.stats().quarantined == 1


# --- 2. damaged record bytes -------------------------------------------------------------------


def corrupt_record_tokens(path: Path, index: int) -> None:
    """Flip a byte inside block `index`'s token ids as its record stores them ('<u4')."""
    needle = struct.pack("<4I", *TOKENS[index * 4 : index * 4 + 4])
    flip_in_file(path / "data.mdb", needle, 6)


@pytest.mark.parametrize("reader", ["longest_prefix", "load"])
def test_corrupt_record_is_quarantined_and_never_a_hit(tmp_path: Path, reader: str) -> None:
    path = tmp_path / "s"
    payloads, hashes = put_chain(path, "none")
    corrupt_record_tokens(path, BAD)

    with open_store(path) as store:
        if reader == "longest_prefix":
            assert store.longest_prefix(IDENT, TOKENS).n_blocks == BAD
        else:
            out = bytearray(sum(map(len, payloads)))
            assert store.load(IDENT, TOKENS, out).n_blocks == BAD
        stats = store.stats()
        assert stats.hit_blocks == BAD  # the damaged block is not counted as a hit
        assert stats.collisions == 0  # nor as a collision
        assert stats.quarantined == 1
        assert stats.blocks == BAD
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == BAD
        for h in hashes[BAD:]:
            assert store.block_info(h) is None

        again = store.put(IDENT, TOKENS, payloads[BAD:], first_block=BAD)
        assert again.stored == N_BLOCKS - BAD
        assert_loads(store, payloads)
        assert store.check() == []


def test_put_over_a_corrupt_record_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "s"
    payloads, _ = put_chain(path, "none")
    corrupt_record_tokens(path, BAD)

    with open_store(path) as store:
        result = store.put(IDENT, TOKENS, payloads)
        assert (result.stored, result.existed) == (N_BLOCKS - BAD, BAD)
        assert store.stats().quarantined == 1
        assert_loads(store, payloads)
        assert store.check() == []


def test_check_is_clean_right_after_a_corrupt_record_is_quarantined(tmp_path: Path) -> None:
    path = tmp_path / "s"
    put_chain(path, "none")
    corrupt_record_tokens(path, BAD)
    with open_store(path) as store:
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == BAD
        assert store.stats().quarantined == 1
        assert store.check() == []


# --- 3. check() finds every damaged payload ----------------------------------------------------


def test_check_reports_every_corrupt_payload(tmp_path: Path) -> None:
    path = tmp_path / "s"
    payloads, hashes = put_chain(path, "none")
    corrupt_payload(path, payloads[1])

    with open_store(path) as store:
        problems = store.check(verify_payloads=True)
        assert [(p.kind, p.block) for p in problems] == [("payload", hashes[1])]
        assert store.check(verify_payloads=False) == []  # sizes still agree
    corrupt_payload(path, payloads[3])

    with open_store(path) as store:
        problems = store.check(verify_payloads=True)
        assert sorted((p.kind, p.block) for p in problems) == sorted(
            [("payload", hashes[1]), ("payload", hashes[3])]
        )
        # check() only reports: nothing was quarantined or removed
        stats = store.stats()
        assert (stats.quarantined, stats.blocks) == (0, N_BLOCKS)
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == N_BLOCKS


def test_check_reports_corrupt_compressed_payloads_of_different_chains(tmp_path: Path) -> None:
    path = tmp_path / "s"
    payloads = text_payloads(2)
    other = [t + 1 for t in TOKENS[:4]]
    with open_store(path, compression="zstd") as store:
        h1 = store.put(IDENT, TOKENS[:4], payloads[:1]).hashes[0]
        h2 = store.put(IDENT, other, payloads[1:]).hashes[0]
    corrupt_stored_chunk(path, h1)
    corrupt_stored_chunk(path, h2)
    with open_store(path) as store:
        problems = store.check()
        assert sorted((p.kind, p.block) for p in problems) == sorted(
            [("payload", h1), ("payload", h2)]
        )


@pytest.mark.parametrize("damage", ["undecodable", "another tenant"])
def test_a_damaged_identity_row_is_reported_and_repair_removes_its_blocks(
    tmp_path: Path, damage: str
) -> None:
    """Quotas, TTLs and a tenant's purge find its blocks through their identity row: a row that
    no longer decodes, or decodes into another identity (tenant "a" flipped into "c"), is reported
    for every block of it and charged to no tenant; repair takes the blocks away."""
    path = tmp_path / "s"
    _, hashes = put_chain(path, "none")
    encoded = IDENT.encode()
    at = 0 if damage == "undecodable" else encoded.index(b"\xa1a") + 1
    data = bytearray((path / "data.mdb").read_bytes())
    start = data.find(encoded)
    while start >= 0:  # every copy: LMDB keeps older pages too
        data[start + at] ^= 0x02
        start = data.find(encoded, start + 1)
    (path / "data.mdb").write_bytes(bytes(data))
    with open_store(path) as store:
        assert sorted((p.kind, p.block) for p in store.check()) == sorted(
            ("identity", h) for h in hashes
        )
        assert set(store.tenant_totals()) <= {""}  # never tenant "c"'s
        store.repair()
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == 0
        assert store.check() == []


# --- 4. the three ways a store does not open ---------------------------------------------------


def test_open_errors_are_distinct_classes() -> None:
    classes = (NotAStoreError, SchemaVersionError, CorruptMetaError)
    for a in classes:
        assert issubclass(a, StoreOpenError)
        for b in classes:
            if a is not b:
                assert not issubclass(a, b), (a, b)


@pytest.mark.parametrize("name", ["lock.mdb", "owner.lock"])
def test_a_store_file_that_is_a_link_is_refused_and_where_it_points_untouched(
    tmp_path: Path, name: str
) -> None:
    """Whoever may write the store's directory (the service user, when root runs an offline
    command) could link a store file to any file: opening writes where the link points (LMDB
    sets up its lock file, the owner lock truncates), so a link is refused."""
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put(IDENT, TOKENS, random_payloads(N_BLOCKS, size=100))
    precious = tmp_path / "precious"
    precious.write_bytes(b"not the store's" * 100)
    (path / name).unlink(missing_ok=True)
    (path / name).symlink_to(precious)
    with pytest.raises(StoreOpenError, match="symbolic link"):
        Store.open(path, map_size=MAP, exclusive=True)
    assert precious.read_bytes() == b"not the store's" * 100


def test_directory_with_unrelated_files_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "d"
    path.mkdir()
    (path / "notes.txt").write_text("not a store")
    (path / "data.bin").write_bytes(b"\x00" * 100)
    before = dir_snapshot(path)
    with pytest.raises(NotAStoreError):
        open_store(path)
    with pytest.raises(NotAStoreError):
        open_store(path, create=False)
    assert dir_snapshot(path) == before


def test_garbage_data_file_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "d"
    path.mkdir()
    garbage = random.Random(7).randbytes(64 << 10)
    (path / "data.mdb").write_bytes(garbage)
    with pytest.raises(NotAStoreError):
        open_store(path)
    assert (path / "data.mdb").read_bytes() == garbage
    assert sorted(p.name for p in path.iterdir()) == ["data.mdb"]  # no lock file left behind


@pytest.mark.parametrize(
    "content", ["other-tables", "meta-table-without-record", "meta-key-in-main-db"]
)
def test_plain_lmdb_environment_is_not_a_store(tmp_path: Path, content: str) -> None:
    path = tmp_path / "d"
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    with env.begin(write=True) as txn:
        txn.put(b"hello", b"world")
        if content == "other-tables":
            other = env.open_db(b"other", txn=txn)
            txn.put(b"k", b"v", db=other)
        elif content == "meta-table-without-record":
            meta = env.open_db(b"meta", txn=txn)
            txn.put(b"not-meta", b"v", db=meta)
        else:
            txn.put(b"meta", b"a plain value, not a named database")
    env.close()
    before = (path / "data.mdb").read_bytes()
    with pytest.raises(NotAStoreError):
        open_store(path)
    assert (path / "data.mdb").read_bytes() == before


def test_missing_path_without_create_is_not_a_store(tmp_path: Path) -> None:
    path = tmp_path / "missing" / "store"
    with pytest.raises(NotAStoreError):
        open_store(path, create=False)
    assert not path.exists()
    assert not path.parent.exists()


def rewrite_meta(path: Path, value: bytes | None = None, transform=None) -> bytes:
    """Replace (or transform) the meta record through the plain lmdb module; return the original."""
    env = lmdb.open(str(path), max_dbs=16, map_size=MAP)
    try:
        meta_db = env.open_db(b"meta", create=False)
        with env.begin(write=True) as txn:
            original = bytes(txn.get(b"meta", db=meta_db))
            txn.put(b"meta", value if value is not None else transform(original), db=meta_db)
        return original
    finally:
        env.close()


def make_store(path: Path) -> list[bytes]:
    payloads = random_payloads(2, size=1000)
    with open_store(path) as store:
        store.put(IDENT, TOKENS[:8], payloads)
    return payloads


def test_unknown_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s"
    payloads = make_store(path)
    settings = {**FORMAT_SETTINGS, "created_ns": 1}
    original = rewrite_meta(path, StoreMeta(schema_version=99, settings=settings).encode())
    with pytest.raises(SchemaVersionError) as caught:
        open_store(path)
    assert caught.value.found == 99
    assert caught.value.supported == SCHEMA_VERSION
    assert not isinstance(caught.value, (NotAStoreError, CorruptMetaError))
    # the refusal changed nothing: with its meta record back, the store opens with its data
    rewrite_meta(path, original)
    with open_store(path) as store:
        assert_loads(store, payloads, TOKENS[:8])


def _flip(offset: int):
    def damage(meta: bytes) -> bytes:
        damaged = bytearray(meta)
        damaged[offset] ^= 0x01
        return bytes(damaged)

    return damage


@pytest.mark.parametrize(
    "damage",
    [
        _flip(16 + 3),  # inside the msgpack settings (after the 16-byte head): a format key
        _flip(-5),  # the settings' last byte (of created_ns): only the checksum can tell
        lambda meta: meta[:-1],
        lambda meta: meta[: len(meta) // 2],
        lambda meta: meta[:12],
    ],
    ids=[
        "flipped-format-key",
        "flipped-created-ns",
        "truncated-by-one",
        "truncated-by-half",
        "truncated-head",
    ],
)
def test_damaged_meta_record_is_corrupt(tmp_path: Path, damage) -> None:
    path = tmp_path / "s"
    payloads = make_store(path)
    original = rewrite_meta(path, transform=damage)
    with pytest.raises(CorruptMetaError) as caught:
        open_store(path)
    assert not isinstance(caught.value, (NotAStoreError, SchemaVersionError))
    rewrite_meta(path, original)
    with open_store(path) as store:
        assert_loads(store, payloads, TOKENS[:8])
        assert store.check() == []


# --- 5. a full map -----------------------------------------------------------------------------

BIG = 256 << 10


Chain = tuple[list[int], list[bytes], tuple[bytes, ...]]


def fill_until_full(store: Store) -> tuple[list[Chain], tuple[list[int], list[bytes]]]:
    """Put two-block chains of 256 KiB payloads until the map is full."""
    rng = np.random.default_rng(3)
    acked = []
    for c in range(64):
        tokens = [c * 8 + j for j in range(8)]
        payloads = [rng.bytes(BIG), rng.bytes(BIG)]
        try:
            result = store.put(IDENT, tokens, payloads)
        except StoreFullError:
            return acked, (tokens, payloads)
        assert result.stored == 2
        acked.append((tokens, payloads, result.hashes))
    pytest.fail("the map never filled up")


def test_full_map_put_is_rolled_back_whole(tmp_path: Path) -> None:
    with open_store(tmp_path / "s", map_size=4 << 20, eviction="none") as store:
        acked, (tokens, payloads) = fill_until_full(store)
        assert len(acked) >= 2
        # the refused put left nothing behind, not even its first block
        assert store.longest_prefix(IDENT, tokens).n_blocks == 0
        stats = store.stats()
        assert stats.blocks == 2 * len(acked)
        assert stats.payload_bytes == 2 * BIG * len(acked)
        assert store.check() == []
        for t, p, _ in acked:
            assert store.longest_prefix(IDENT, t).n_blocks == 2
            assert_loads(store, p, t)
        # still full: refused again, still whole
        with pytest.raises(StoreFullError):
            store.put(IDENT, tokens, payloads)
        assert store.longest_prefix(IDENT, tokens).n_blocks == 0

        # evict (LMDB reuses the pages a transaction freed once a later one has committed, so
        # the eviction takes two transactions here)
        assert store.delete([acked[0][2][0]]) == 2
        assert store.delete([acked[1][2][0]]) == 2
        assert store.longest_prefix(IDENT, acked[0][0]).n_blocks == 0
        result = store.put(IDENT, tokens, payloads)
        assert result.stored == 2
        assert_loads(store, payloads, tokens)
        for t, p, _ in acked[2:]:
            assert_loads(store, p, t)
        assert store.check() == []
        assert store.stats().blocks == 2 * (len(acked) - 1)


def test_put_right_after_freeing_delete_succeeds(tmp_path: Path) -> None:
    """LMDB reuses freed pages only after a later commit; the store settles and retries."""
    with open_store(tmp_path / "s", map_size=4 << 20, eviction="none") as store:
        acked, (tokens, payloads) = fill_until_full(store)
        assert store.delete([acked[0][2][0]]) == 2  # frees as much as the refused put needs
        store.put(IDENT, tokens, payloads)
        assert_loads(store, payloads, tokens)


class FullMapEnv:
    """A store's environment whose write transactions all fail at commit as a full map does,
    and whose copies fail as a full disk does (LMDB's own error, as it would come)."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env

    def begin(self, *, write: bool = False, **kwargs: object) -> object:
        txn = self._env.begin(write=write, **kwargs)
        return FullAtCommit(txn) if write else txn

    def copy(self, path: str, compact: bool = False) -> None:
        raise lmdb.Error(f"{path}: No space left on device")

    def __getattr__(self, name: str) -> object:
        return getattr(self._env, name)


class FullAtCommit:
    """A write transaction that does its work, then fails to commit with MDB_MAP_FULL."""

    def __init__(self, txn: lmdb.Transaction) -> None:
        self._txn = txn

    def __getattr__(self, name: str) -> object:
        return getattr(self._txn, name)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        self._txn.abort()
        if kind is None:
            raise lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL: Environment mapsize limit")

    def commit(self) -> None:
        self.__exit__(None)


def _writes(store: Store, tmp_path: Path) -> dict[str, Callable[[], object]]:
    """Each path that writes, set to write something."""
    return {
        "evict": lambda: store.evict(0),
        "reclaim_expired": store.reclaim_expired,
        "repair": store.repair,
        "compact_to": lambda: store.compact_to(tmp_path / "copy"),
        "delete": lambda: store.delete([store.longest_prefix(IDENT, TOKENS).hashes[1]]),
        "purge": lambda: store.purge(PurgeSelector(tenant="a")),
        "put": lambda: store.put(IDENT, TOKENS + [1, 2, 3, 4], [b"x" * 100], first_block=4),
    }


@pytest.mark.parametrize(
    "operation",
    ["evict", "reclaim_expired", "repair", "compact_to", "delete", "purge", "put"],
)
def test_a_full_map_in_any_write_is_a_store_full_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, operation: str
) -> None:
    """Every path that writes reports a full map (or, for the compacted copy, a full disk under
    it) as StoreFullError, never as an lmdb error, and leaves the store as it was."""
    clock = ManualClock()
    ttls = ("a=1h",) if operation == "reclaim_expired" else ()
    with open_store(tmp_path / "s", clock=clock, tenant_ttls=ttls) as store:
        store.put(IDENT, TOKENS, random_payloads(N_BLOCKS, size=1000))
        if ttls:
            clock.advance(7200)  # past the tenant's time to live: there is something to reclaim
        call = _writes(store, tmp_path)[operation]
        monkeypatch.setattr(lmdb_errors, "free_bytes", lambda path: 0)  # the copy's disk is full
        ctx = store._ctx
        real = ctx.env
        ctx.env = FullMapEnv(real)
        try:
            with pytest.raises(StoreFullError) as caught:
                call()
        finally:
            ctx.env = real
        assert not isinstance(caught.value, lmdb.Error) and "full" in str(caught.value)
        assert store.stats().blocks == N_BLOCKS and store.check() == []


@pytest.mark.parametrize(
    "error",
    [
        lmdb.MapFullError("mdb_txn_commit: MDB_MAP_FULL: Environment mapsize limit"),
        lmdb.Error("mdb_txn_commit: No space left on device"),
        lmdb.DiskError("mdb_txn_commit: Input/output error"),  # its fsync, under `full`
    ],
)
def test_a_failure_of_the_eviction_after_a_put_leaves_the_put_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: lmdb.Error
) -> None:
    """The put committed before the quota's eviction ran: that eviction failing (a full map, a
    full disk, an I/O error) is no reason to tell the caller the put was rolled back (it was not,
    and its blocks serve)."""
    from prefixd.store import put as put_path

    def full(*args: object, **kwargs: object) -> object:
        raise error

    with open_store(tmp_path / "s", tenant_quota_bytes=2000) as store:
        monkeypatch.setattr(put_path, "evict", full)
        result = store.put(IDENT, TOKENS, random_payloads(N_BLOCKS, size=1000))
        assert result.stored == N_BLOCKS
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == N_BLOCKS
        monkeypatch.undo()
        assert store.check() == []


# --- 6. kill -9 in the middle of a stream of puts ---------------------------------------------

CHILD = textwrap.dedent(
    """
    import random, sys
    from prefixd import Identity, Store

    path, start = sys.argv[1], int(sys.argv[2])
    ident = Identity(model="m", weights="w", tokenizer="t", template="c", rope="r",
                     kv_layout="bf16", block_tokens=4, tenant="a")
    store = Store.open(path, map_size=256 << 20, durability="periodic", sync_interval_s=0.01)
    print("ready", flush=True)
    i = start
    while True:
        tokens = list(range(4 * (i + 1)))
        store.put(ident, tokens, [random.Random(i).randbytes(12000 + 13 * (i % 50))],
                  first_block=i)
        if i % 3 == 0:
            store.longest_prefix(ident, tokens)  # access times for the background sync to write
        print(i, flush=True)
        i += 1
    """
)


def expected_payload(i: int) -> bytes:
    return random.Random(i).randbytes(12000 + 13 * (i % 50))


def test_kill_9_loses_no_acknowledged_put(tmp_path: Path) -> None:
    path = tmp_path / "s"
    script = tmp_path / "writer.py"
    script.write_text(CHILD)
    stored = 0
    for kill_after in (10, 40, 3):
        with open(tmp_path / "stderr.txt", "w") as err:
            child = subprocess.Popen(
                [sys.executable, str(script), str(path), str(stored)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
            try:
                assert child.stdout.readline() == "ready\n", (tmp_path / "stderr.txt").read_text()
                acks = []
                while len(acks) < kill_after:
                    line = child.stdout.readline()
                    assert line, (tmp_path / "stderr.txt").read_text()
                    acks.append(int(line))
                os.kill(child.pid, signal.SIGKILL)
                acks += [int(line) for line in child.stdout.read().split()]
            finally:
                child.kill()
                child.wait(timeout=30)
                child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        assert acks == list(range(stored, stored + len(acks)))
        acknowledged = stored + len(acks)

        with open_store(path, map_size=256 << 20) as store:
            tokens = list(range(4 * (acknowledged + 1)))
            match = store.longest_prefix(IDENT, tokens)
            # every acknowledged put survived; the one in flight may or may not have committed
            assert match.n_blocks in (acknowledged, acknowledged + 1)
            dests = [bytearray(ref.payload_size) for ref in match.blocks]
            read = store.read_into(match, dests)
            assert read.n_blocks == match.n_blocks
            for i, dest in enumerate(dests):
                assert bytes(dest) == expected_payload(i), i
            assert store.check() == []
            assert store.stats().blocks == match.n_blocks
            stored = match.n_blocks


# --- 7. fork -----------------------------------------------------------------------------------


@pytest.mark.skipif(
    not hasattr(os, "fork") or not hasattr(os, "pidfd_open"), reason="needs os.fork, pidfd_open"
)
def test_store_is_refused_in_a_forked_child(tmp_path: Path) -> None:
    payloads = random_payloads(2, size=1000)
    with open_store(tmp_path / "s") as store:
        store.put(IDENT, TOKENS[:8], payloads)
        match = store.longest_prefix(IDENT, TOKENS[:8])
        calls = [
            lambda: store.longest_prefix(IDENT, TOKENS[:8]),
            lambda: store.put(IDENT, TOKENS, random_payloads(4, size=100)),
            lambda: store.delete([match.blocks[0].hash]),
            lambda: store.load(IDENT, TOKENS[:8], bytearray(4096)),
            lambda: store.read_into(match, [bytearray(4096), bytearray(4096)]),
            lambda: store.block_info(match.blocks[0].hash),
            lambda: store.sync(),
            lambda: store.stats(),
            lambda: store.check(),
        ]
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 100
            try:
                code = 0
                for n, call in enumerate(calls, start=1):
                    try:
                        call()
                    except StoreClosedError:
                        continue
                    code = n  # this call was not refused
                    break
                store.close()  # closes nothing of the parent's
            except BaseException:  # noqa: BLE001
                code = 99
            finally:
                os._exit(code)
        exited = os.pidfd_open(pid)  # readable once the child has exited
        try:
            if not select.select([exited], [], [], 30)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("forked child hung")
        finally:
            os.close(exited)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

        # the parent's store is untouched and still usable
        assert store.longest_prefix(IDENT, TOKENS[:8]).n_blocks == 2
        assert_loads(store, payloads, TOKENS[:8])
        assert store.check() == []


# --- a destination that changes under a load ---------------------------------------------------


def test_a_destination_written_during_a_load_never_quarantines_a_healthy_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that writes into its own region while the daemon copies a payload there makes
    that copy fail its checksum. The stored bytes are intact: that load stops, nothing goes."""
    from prefixd.store import codec

    payloads = [bytes([i]) * (16 << 10) for i in range(N_BLOCKS)]
    original = codec._copy_and_checksum

    def copy_then_scribbled(chunks: list[memoryview], dest: memoryview) -> int:
        value = original(chunks, dest)
        if chunks[0][0] == BAD:  # block BAD: the client writes into it mid-copy
            dest[0] ^= 0xFF
            return int(crc32c.crc32c(dest[: sum(c.nbytes for c in chunks)]))
        return value

    path = tmp_path / "s"
    with open_store(path, compression="none") as store:
        store.put(IDENT, TOKENS, payloads)
        monkeypatch.setattr(codec, "_copy_and_checksum", copy_then_scribbled)
        out = bytearray(sum(map(len, payloads)))
        assert store.load(IDENT, TOKENS, out).n_blocks == BAD  # this load stops there
        stats = store.stats()
        assert (stats.quarantined, stats.blocks, stats.destinations_changed) == (0, N_BLOCKS, 1)
        monkeypatch.setattr(codec, "_copy_and_checksum", original)
        assert_loads(store, payloads)  # every block still there, verified
        assert store.check() == []


# --- a payload that changes under a put ---------------------------------------------------------


def test_a_payload_rewritten_during_a_put_is_refused_never_stored_corrupt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client rewriting its payload in its region after the daemon checksummed it and before
    LMDB copied it: the put is refused whole, so no block is acknowledged whose stored bytes do
    not match its checksum (an honest client's identical put later stores it afresh)."""
    from prefixd.store import commits

    payloads = [bytearray(p) for p in random_payloads(N_BLOCKS)]
    original = commits.transact

    def rewritten_first(
        ctx: object, body: Callable[[lmdb.Transaction], object], aborts: object
    ) -> object:
        payloads[BAD][100] ^= 0xFF  # checksummed already; LMDB copies it inside the transaction
        return original(ctx, body, aborts)  # type: ignore[arg-type]

    with open_store(tmp_path / "s", compression="none") as store:
        monkeypatch.setattr(commits, "transact", rewritten_first)
        with pytest.raises(PayloadError, match="changed while it was being stored"):
            store.put(IDENT, TOKENS, payloads)
        assert store.stats().blocks == 0  # nothing of that put was stored
        monkeypatch.setattr(commits, "transact", original)
        honest = [bytes(p) for p in payloads]
        assert store.put(IDENT, TOKENS, honest).stored == N_BLOCKS
        assert_loads(store, honest)
        assert store.check() == []


LARGE = 1 << 20  # payloads whose put (over 4 MiB) has its checksums taken on the pool
GIVE_UP_S = 30.0  # only bounds a failing run: a passing one never waits on it


def test_a_large_raw_puts_checksums_are_taken_while_its_transaction_copies_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The crc32c of a large raw put's payloads is taken on the pool while its transaction copies
    them into LMDB, not before the transaction begins: the two passes overlap on two cores."""
    from prefixd.store import codec, commits

    began = threading.Event()
    taken_before: list[bool] = []
    original_checksum, original_transact = codec.checksum, commits.transact

    def checksum(chunks: Sequence[bytes | bytearray | memoryview]) -> int:
        if threading.current_thread() is not threading.main_thread():
            began.wait(GIVE_UP_S)  # the pool waits for the transaction: overlap, made certain
        taken_before.append(not began.is_set())
        return original_checksum(chunks)

    def transact(ctx: object, body: Callable[[lmdb.Transaction], object], aborts: object) -> object:
        began.set()
        return original_transact(ctx, body, aborts)  # type: ignore[arg-type]

    payloads = random_payloads(N_BLOCKS, LARGE)
    with open_store(tmp_path / "s", compression="none", verify_threads=1) as store:
        monkeypatch.setattr(codec, "checksum", checksum)
        monkeypatch.setattr(commits, "transact", transact)
        assert store.put(IDENT, TOKENS, payloads).stored == N_BLOCKS
        assert taken_before == [False] * N_BLOCKS
        assert_loads(store, payloads)
        assert store.check() == []


def test_a_payload_rewritten_after_lmdb_copied_it_and_before_its_checksum_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window the pool's checksums open: LMDB holds the payload as it was, the client rewrites
    it, then the pool takes its checksum. The stored bytes no longer match the bytes checksummed,
    so the put is refused whole rather than stored under a checksum of bytes it never held."""
    from prefixd.store import codec, put

    payloads = [bytearray(p) for p in random_payloads(N_BLOCKS, LARGE)]
    copied = threading.Event()
    original_checksum, original_put_chunks = codec.checksum, put._put_chunks

    def checksum(chunks: Sequence[bytes | bytearray | memoryview]) -> int:
        copied.wait(GIVE_UP_S)  # taken only once LMDB holds every payload
        return original_checksum(chunks)

    def put_chunks(txn: lmdb.Transaction, t: object, owner: bytes, chunks: Sequence[object]) -> int:
        stored = original_put_chunks(txn, t, owner, chunks)  # type: ignore[arg-type]
        if bytes(chunks[0][:16]) == bytes(payloads[BAD][:16]):  # type: ignore[index]
            payloads[BAD][100] ^= 0xFF  # LMDB holds it as it was; its checksum is not taken yet
        if bytes(chunks[0][:16]) == bytes(payloads[-1][:16]):  # type: ignore[index]
            copied.set()
        return stored

    with open_store(tmp_path / "s", compression="none", verify_threads=1) as store:
        monkeypatch.setattr(codec, "checksum", checksum)
        monkeypatch.setattr(put, "_put_chunks", put_chunks)
        with pytest.raises(PayloadError, match=f"block {BAD}'s payload changed"):
            store.put(IDENT, TOKENS, payloads)
        assert store.stats().blocks == 0
        assert store.check() == []
