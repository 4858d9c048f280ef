"""The FairPool and the loads it serves: pieces of every job in turn, a failure ends only its own
job, and loads split into pieces still verify every byte they report, all at once from many
threads."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.store.codec import PIECE_BYTES, Deadline, PayloadCodec, StoredPayload
from prefixd.store.fair import FairPool, default_threads

from .test_codec import stored

BLOCK_TOKENS = 16
BLOCK = 256 << 10  # four blocks to a piece


def test_pieces_of_every_job_run_in_turn() -> None:
    pool = FairPool(1)
    order: list[str] = []
    started = threading.Event()
    release = threading.Event()

    def first() -> bool:
        started.set()
        release.wait()
        order.append("a0")
        return True

    def step(name: str) -> bool:
        order.append(name)
        return True

    big = threading.Thread(
        target=pool.run, args=([first] + [lambda i=i: step(f"a{i}") for i in range(1, 4)],)
    )
    big.start()
    started.wait()  # the one thread holds a0: b's job is queued behind a's next piece
    small = threading.Thread(target=pool.run, args=([lambda: step("b0"), lambda: step("b1")],))
    small.start()
    with pool._cond:  # queuing b's job notifies the condition; the one thread is in a0
        assert pool._cond.wait_for(lambda: len(pool._jobs) == 2, timeout=60)  # a's rest, then b
    release.set()
    big.join()
    small.join()
    pool.close()
    # one piece of each job in turn: b does not wait for all of a
    assert order == ["a0", "a1", "b0", "a2", "b1", "a3"]


def test_a_failed_piece_ends_its_job_and_no_other() -> None:
    pool = FairPool(1)
    ran: list[int] = []

    def piece(i: int, ok: bool = True) -> bool:
        ran.append(i)
        return ok

    outcomes = pool.run([lambda: piece(0), lambda: piece(1, ok=False), lambda: piece(2)])
    assert outcomes == [True, False, None]  # the piece after the failure never started
    assert ran == [0, 1]
    assert pool.run([lambda: piece(3), lambda: piece(4)]) == [True, True]
    pool.close()
    assert pool.run([lambda: piece(5)]) == [True]  # after close: on the caller's thread


def test_an_exception_reaches_the_caller_after_the_other_pieces() -> None:
    pool = FairPool(2)

    def boom() -> bool:
        raise RuntimeError("piece failed")

    with pytest.raises(RuntimeError, match="piece failed"):
        pool.run([lambda: True, boom, lambda: True])
    assert pool.run([lambda: True]) == [True]
    pool.close()


def test_default_threads_suit_a_small_node() -> None:
    assert 2 <= default_threads() <= 64


def _items(codec: PayloadCodec, datas: list[bytes], dests: list[bytearray]) -> list[StoredPayload]:
    return [stored(codec.encode(memoryview(d)), memoryview(dest)) for d, dest in zip(datas, dests)]


def test_a_split_load_reports_only_the_verified_prefix() -> None:
    codec = PayloadCodec("none", level=1, min_gain=0.05, chunk_bytes=BLOCK)
    n = 4 * PIECE_BYTES // BLOCK  # four pieces
    datas = [bytes([i + 1]) * BLOCK for i in range(n)]
    dests = [bytearray(BLOCK) for _ in range(n)]
    items = _items(codec, datas, dests)
    bad = n // 2 + 1  # inside the third piece
    items[bad].chunks[0] = memoryview(b"\x00" * BLOCK)
    pool = FairPool(1)  # pieces start in order: the fourth never starts
    try:
        assert codec.decode_verified(items, pool) == bad
    finally:
        pool.close()
    assert all(bytes(dests[i]) == datas[i] for i in range(bad))
    assert not any(any(d) for d in dests[bad:])  # nothing unreported is left behind
    assert codec.counters.verify_failures == 1
    assert codec.counters.copied_bytes == bad * BLOCK  # the fourth piece never ran


def test_a_split_load_stops_at_its_deadline_between_pieces() -> None:
    codec = PayloadCodec("none", level=1, min_gain=0.05, chunk_bytes=BLOCK)
    n = 3 * PIECE_BYTES // BLOCK
    datas = [bytes([i + 1]) * BLOCK for i in range(n)]
    dests = [bytearray(BLOCK) for _ in range(n)]
    items = _items(codec, datas, dests)
    per_piece = PIECE_BYTES // BLOCK
    reads = iter(range(10_000))
    deadline = Deadline(lambda: float(next(reads)), float(per_piece))  # one check per block
    pool = FairPool(1)
    try:
        verified = codec.decode_verified(items, pool, deadline)
    finally:
        pool.close()
    assert verified == per_piece  # the first piece, then the deadline
    assert deadline.stopped_at(items[verified])
    assert codec.counters.deadline_cutoffs == 1 and codec.counters.verify_failures == 0
    assert not any(any(d) for d in dests[verified:])
    assert all(bytes(dests[i]) == datas[i] for i in range(verified))


IDENTITY = Identity(
    model="fair",
    weights="sha256:" + "2" * 64,
    tokenizer="t",
    template="v1",
    rope="r",
    kv_layout=f"bf16/{BLOCK}B",
    block_tokens=BLOCK_TOKENS,
    tenant="fair",
)


@pytest.mark.parametrize("read_path", ["auto", "mmap"])
def test_many_concurrent_split_loads_of_overlapping_chains(tmp_path: Path, read_path: str) -> None:
    rng = np.random.default_rng(7)
    n_blocks = 3 * PIECE_BYTES // BLOCK + 1
    payloads = [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(n_blocks)]
    tokens = rng.integers(0, 50_000, n_blocks * BLOCK_TOKENS, dtype=np.uint32)
    other = tokens.copy()
    fork = n_blocks // 2  # a second chain sharing the first half
    other[fork * BLOCK_TOKENS :] += 1
    other_payloads = payloads[:fork] + [p[::-1].copy() for p in payloads[fork:]]
    chains = [(tokens, payloads), (other, other_payloads)]
    failures: list[str] = []
    with Store.open(
        tmp_path / "s", map_size=256 << 20, verify_threads=2, read_path=read_path
    ) as store:
        for chain_tokens, chain_payloads in chains:
            assert store.put(IDENTITY, chain_tokens, chain_payloads).stored >= n_blocks - fork
        start = threading.Barrier(8)

        def loader(index: int) -> None:
            chain_tokens, chain_payloads = chains[index % 2]
            dest = np.empty(n_blocks * BLOCK, dtype=np.uint8)
            start.wait()
            for round_ in range(6):
                blocks = n_blocks - (index + round_) % 5  # prefixes of several lengths
                dest.fill(0xA5)
                result = store.load(IDENTITY, chain_tokens[: blocks * BLOCK_TOKENS], dest)
                expected = np.concatenate(chain_payloads[:blocks])
                if result.n_blocks != blocks or not np.array_equal(
                    dest[: blocks * BLOCK], expected
                ):
                    failures.append(f"loader {index} round {round_}: {result.n_blocks} blocks")

        threads = [threading.Thread(target=loader, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert store.stats().quarantined == 0
    assert failures == []
