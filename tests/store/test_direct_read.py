"""Loads that read raw payloads with preadv from data.mdb (read_path, prefixd.store.direct): the
same guarantees as the copy out of LMDB's map. Damage at rest is a miss and a quarantine; a file
cut short under an open store is a miss and no crash; puts, deletes and evictions running beside
a load never change what it reads; a destination written during a load never quarantines."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from prefixd import Store
from prefixd.clock import ManualClock
from prefixd.schema.state import StateGroup
from prefixd.store import codec, direct

from .test_faults import BAD, IDENT, N_BLOCKS, SENTINEL, TOKENS, assert_loads, corrupt_payload
from .test_joint import hybrid

MAP = 64 << 20
BIG = 160 << 10  # over direct.PREAD_MIN_BYTES: read from the file by `auto` too
CHUNK = 64 << 10  # several chunks per payload, each its own overflow run


def big_payloads(n: int = N_BLOCKS, seed: int = 3) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BIG + 4096 * i, dtype=np.uint8).tobytes() for i in range(n)]


def open_store(path: Path, read_path: str = "pread", **settings: object) -> Store:
    return Store.open(path, map_size=MAP, chunk_bytes=CHUNK, read_path=read_path, **settings)


@pytest.mark.parametrize("read_path", ["auto", "pread", "mmap"])
def test_large_raw_payloads_are_read_from_the_file_unless_mmap(
    tmp_path: Path, read_path: str
) -> None:
    payloads = big_payloads()
    with open_store(tmp_path / "s", read_path) as store:
        store.put(IDENT, TOKENS, payloads)
        assert_loads(store, payloads)
        expected = sum(map(len, payloads)) if read_path != "mmap" else 0
        assert store.stats().file_read_bytes == expected


def test_auto_copies_small_and_compressed_payloads_from_the_map(tmp_path: Path) -> None:
    small = [bytes([i]) * 4096 for i in range(N_BLOCKS)]
    with open_store(tmp_path / "s", "auto", compression="zstd") as store:
        store.put(IDENT, TOKENS, [p * 40 for p in small])  # compressible: stored compressed
        assert_loads(store, [p * 40 for p in small])
    with open_store(tmp_path / "t", "auto") as store:
        store.put(IDENT, TOKENS, small)
        assert_loads(store, small)
        assert store.stats().file_read_bytes == 0


@pytest.mark.parametrize("read_path", ["auto", "pread"])
@pytest.mark.parametrize("reader", ["load", "read_into", "export_block"])
def test_a_payload_damaged_at_rest_is_a_miss_zeroed_and_quarantined(
    tmp_path: Path, read_path: str, reader: str
) -> None:
    path = tmp_path / "s"
    payloads = big_payloads()
    with open_store(path, read_path) as store:
        hashes = store.put(IDENT, TOKENS, payloads).hashes
    corrupt_payload(path, payloads[BAD])
    with open_store(path, read_path) as store:
        sizes = [len(p) for p in payloads]
        if reader == "load":
            out = bytearray([SENTINEL]) * sum(sizes)
            loaded = store.load(IDENT, TOKENS, out)
            assert loaded.n_blocks == BAD
            start = sum(sizes[:BAD])
            assert bytes(out[start : start + sizes[BAD]]) == bytes(sizes[BAD])  # zeroed
        elif reader == "read_into":
            dests = [bytearray([SENTINEL]) * n for n in sizes]
            assert store.read_into(store.longest_prefix(IDENT, TOKENS), dests).n_blocks == BAD
            assert bytes(dests[BAD]) == bytes(sizes[BAD])
            assert [bytes(d) for d in dests[:BAD]] == payloads[:BAD]
        else:
            assert store.export_block(hashes[BAD - 1]) is not None
            assert store.export_block(hashes[BAD]) is None
        stats = store.stats()
        assert (stats.quarantined, stats.blocks, stats.destinations_changed) == (1, BAD, 0)
        assert store.check() == []
        store.put(IDENT, TOKENS, payloads[BAD:], first_block=BAD)
        assert_loads(store, payloads)


def test_a_damaged_state_part_read_from_the_file_is_quarantined(tmp_path: Path) -> None:
    ident = hybrid(4, StateGroup.paged("kv", page_blocks=1))
    tokens = np.asarray(TOKENS, dtype=np.uint32)
    pages = big_payloads()
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put_state(ident, tokens, paged={"kv": pages})
    corrupt_payload(path, pages[BAD])
    with open_store(path) as store:
        out = bytearray(sum(map(len, pages)))
        result = store.load_state(ident, tokens, out)
        assert result.match.matched_tokens == BAD * 4
        for part, offset, page in zip(result.match.parts, result.offsets, pages):
            assert bytes(out[offset : offset + part.payload_size]) == page
        assert store.stats().quarantined == 1
        assert store.stats().file_read_bytes > 0


def test_a_data_file_cut_short_under_an_open_store_is_a_miss_never_a_crash(
    tmp_path: Path,
) -> None:
    """Copying from the map, a page past the end of the file kills the process (SIGBUS); read
    from the file, it is a short read: that load stops there, and nothing is removed (removing
    the block would make LMDB read those pages through its map). The store's descriptor of
    data.mdb is pointed at a copy cut inside the last payload (cutting the file LMDB maps would
    fault wherever LMDB itself meets a missing page, a record or a branch)."""
    path = tmp_path / "s"
    payloads = big_payloads()
    with open_store(path) as store:
        store.put(IDENT, TOKENS, payloads)
        data = (path / "data.mdb").read_bytes()
        cut = data.find(payloads[-1][: 1 << 10]) + (1 << 10)  # inside the last payload
        assert cut > 1 << 10
        (tmp_path / "cut.mdb").write_bytes(data[:cut])
        data_file = store._ctx.data_file
        assert data_file is not None
        whole = os.dup(data_file.fd)
        cut_short = os.open(tmp_path / "cut.mdb", os.O_RDONLY)
        os.dup2(cut_short, data_file.fd)
        os.close(cut_short)
        try:
            out = bytearray([SENTINEL]) * sum(map(len, payloads))
            loaded = store.load(IDENT, TOKENS, out)
            assert loaded.n_blocks == N_BLOCKS - 1
            assert not any(out[loaded.offsets[-1] + loaded.sizes[-1] :])  # zeroed, not served
            stats = store.stats()
            assert (stats.quarantined, stats.blocks, stats.destinations_changed) == (
                0,
                N_BLOCKS,
                0,
            )
        finally:
            os.dup2(whole, data_file.fd)  # the whole file again: the store serves it all
            os.close(whole)
        assert_loads(store, payloads)


def test_a_destination_written_during_a_read_from_the_file_never_quarantines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client writes into its region while the daemon reads block BAD's chunks there: that
    load stops at BAD; the stored bytes are checked again, from the file, and nothing goes."""
    payloads = big_payloads()
    original = codec._pread_exactly
    scribbled = threading.Event()

    def read_then_scribbled(fd: int, target: memoryview, at: int) -> bool:
        done = original(fd, target, at)
        if bytes(target[:64]) == payloads[BAD][:64] and not scribbled.is_set():
            target[10] ^= 0xFF  # after the read, before the checksum of this piece
            scribbled.set()
        return done

    with open_store(tmp_path / "s") as store:
        store.put(IDENT, TOKENS, payloads)
        monkeypatch.setattr(codec, "_pread_exactly", read_then_scribbled)
        out = bytearray(sum(map(len, payloads)))
        assert store.load(IDENT, TOKENS, out).n_blocks == BAD
        assert scribbled.is_set()
        stats = store.stats()
        assert (stats.quarantined, stats.blocks, stats.destinations_changed) == (0, N_BLOCKS, 1)
        assert_loads(store, payloads)
        assert store.check() == []


@pytest.mark.parametrize("change", ["delete", "evict"])
def test_writes_during_a_read_from_the_file_never_change_what_it_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """A load stalls in its first read from the file while another thread removes every block
    it is reading and fills the freed space with other payloads. The load's read transaction
    keeps LMDB from reusing those pages: it still serves exactly the bytes it found."""
    payloads = big_payloads()
    others = big_payloads(seed=9)
    other_tokens = [t + 1000 for t in TOKENS]
    original = codec._pread_exactly
    reading, rewritten = threading.Event(), threading.Event()

    def stalled(fd: int, target: memoryview, at: int) -> bool:
        if not reading.is_set():
            reading.set()
            assert rewritten.wait(30)
        return original(fd, target, at)

    with open_store(tmp_path / "s", verify_threads=0) as store:
        hashes = store.put(IDENT, TOKENS, payloads).hashes

        def rewrite() -> None:
            assert reading.wait(30)
            if change == "delete":
                assert store.delete(hashes[:1]) == N_BLOCKS
            else:
                assert store.evict(0).blocks == N_BLOCKS
            for round_ in range(4):  # LMDB would reuse the freed pages for these
                tokens = [t + round_ * 7919 for t in other_tokens]
                assert store.put(IDENT, tokens, others).stored == N_BLOCKS
                store.delete(store.chain_of(IDENT, tokens)[:1])
            rewritten.set()

        writer = threading.Thread(target=rewrite)
        writer.start()
        monkeypatch.setattr(codec, "_pread_exactly", stalled)
        out = bytearray(sum(map(len, payloads)))
        loaded = store.load(IDENT, TOKENS, out)
        writer.join()
        assert rewritten.is_set()
        assert loaded.n_blocks == N_BLOCKS
        for offset, size, expected in zip(loaded.offsets, loaded.sizes, payloads):
            assert bytes(out[offset : offset + size]) == expected
        assert store.stats().quarantined == 0
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == 0  # they are gone now


def test_loads_beside_puts_and_deletes_serve_only_the_bytes_put(tmp_path: Path) -> None:
    """Threads: one keeps loading a chain read from the file while another puts and deletes
    other chains (pages freed and reused all along). Every load is whole and exact."""
    payloads = big_payloads()
    others = big_payloads(seed=5)
    stop = threading.Event()
    with open_store(tmp_path / "s") as store:
        store.put(IDENT, TOKENS, payloads)

        def churn() -> None:
            round_ = 0
            while not stop.is_set():
                tokens = [t + 10_000 + round_ for t in TOKENS]
                store.put(IDENT, tokens, others)
                store.delete(store.chain_of(IDENT, tokens)[:1])
                round_ += 1

        writer = threading.Thread(target=churn)
        writer.start()
        try:
            for _ in range(40):
                assert_loads(store, payloads)
        finally:
            stop.set()
            writer.join()
        assert store.stats().quarantined == 0
        assert store.check() == []


# --- the deadline of a load on slow storage ----------------------------------------------------


def test_a_read_stalled_past_the_deadline_answers_the_blocks_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The read of block BAD stalls (the injected clock moves past the deadline while it
    waits): the load stops reading and answers blocks 0..BAD-1, verified; it is counted as a
    cut-off, not a failure, and nothing is quarantined."""
    clock = ManualClock()
    payloads = big_payloads()
    original = codec._pread_exactly

    def stalled_at_bad(fd: int, target: memoryview, at: int) -> bool:
        done = original(fd, target, at)
        if bytes(target[:64]) == payloads[BAD][:64]:
            clock.advance(10.0)  # slow storage: this read took ten seconds
        return done

    path = tmp_path / "s"
    with Store.open(
        path,
        map_size=MAP,
        chunk_bytes=CHUNK,
        clock=clock,
        verify_threads=0,  # in order
    ) as store:
        store.put(IDENT, TOKENS, payloads)
        monkeypatch.setattr(codec, "_pread_exactly", stalled_at_bad)
        out = bytearray([SENTINEL]) * sum(map(len, payloads))
        loaded = store.load(IDENT, TOKENS, out, deadline=clock.monotonic() + 5.0)
        assert (loaded.n_blocks, loaded.next_size) == (BAD, 0)
        for offset, size, expected in zip(loaded.offsets, loaded.sizes, payloads):
            assert bytes(out[offset : offset + size]) == expected
        assert not any(out[sum(loaded.sizes) :])  # the rest zeroed: nothing unverified left
        stats = store.stats()
        assert (stats.deadline_cutoffs, stats.verify_failures, stats.quarantined) == (1, 0, 0)
        monkeypatch.setattr(codec, "_pread_exactly", original)
        assert store.load(IDENT, TOKENS, out, deadline=clock.monotonic() + 5.0).n_blocks == 4
        assert store.stats().deadline_cutoffs == 1


def test_a_copy_from_the_map_past_the_deadline_stops_before_the_next_block(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = ManualClock()
    payloads = [bytes([i]) * (16 << 10) for i in range(N_BLOCKS)]
    original = codec._copy_and_checksum

    def stalled_at_bad(chunks: list[memoryview], dest: memoryview) -> int:
        value = original(chunks, dest)
        if chunks[0][0] == BAD:
            clock.advance(10.0)
        return value

    settings = {"map_size": MAP, "read_path": "mmap", "verify_threads": 0}  # one run, in order
    with Store.open(tmp_path / "s", clock=clock, **settings) as store:
        store.put(IDENT, TOKENS, payloads)
        monkeypatch.setattr(codec, "_copy_and_checksum", stalled_at_bad)
        out = bytearray(sum(map(len, payloads)))
        loaded = store.load(IDENT, TOKENS, out, deadline=clock.monotonic() + 5.0)
        assert loaded.n_blocks == BAD + 1
        assert store.stats().deadline_cutoffs == 1
        assert store.stats().quarantined == 0


def test_read_ahead_merges_chunks_close_together_into_one_range() -> None:
    gap = codec.READ_AHEAD_GAP
    spans = [(5_000_000, 100), (0, 1000), (1000 + gap, 500), (1000 + gap + 500 + gap + 1, 10)]
    assert codec.read_ahead_ranges(spans) == [
        (0, 1000 + gap + 500),  # the gap of READ_AHEAD_GAP bytes is read too
        (1000 + gap + 500 + gap + 1, 10),  # one byte further: a range of its own
        (5_000_000, 100),
    ]
    assert codec.read_ahead_ranges([(0, 100), (10, 20), (50, 100)]) == [(0, 150)]  # overlaps
    assert codec.read_ahead_ranges([]) == []


def test_a_load_asks_the_kernel_for_a_chains_chunks_in_few_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payloads = big_payloads()  # several chunks each, between them the pages of other tables
    calls: list[tuple[int, int]] = []
    fadvise = os.posix_fadvise

    def counted(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append((offset, length))
        fadvise(fd, offset, length, advice)

    with open_store(tmp_path / "s") as store:
        store.put(IDENT, TOKENS, payloads)
        monkeypatch.setattr(codec.os, "posix_fadvise", counted)
        assert_loads(store, payloads)
    chunks = sum(-(-len(p) // CHUNK) for p in payloads)
    assert chunks >= 3 * N_BLOCKS
    assert 1 <= len(calls) <= N_BLOCKS  # one call per chunk before: `chunks` calls
    asked = sorted(calls)
    assert sum(length for _, length in asked) >= sum(map(len, payloads))


def test_the_maps_are_read_when_the_store_opens_not_by_its_first_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    payloads = big_payloads()
    with open_store(tmp_path / "s") as store:
        store.put(IDENT, TOKENS, payloads)
    with open_store(tmp_path / "s") as store:
        reads: list[Path] = []
        maps_of = direct._maps_of
        monkeypatch.setattr(direct, "_maps_of", lambda path: reads.append(path) or maps_of(path))
        assert_loads(store, payloads)
        assert store.stats().file_read_bytes == sum(map(len, payloads))  # read from the file
    assert reads == []
