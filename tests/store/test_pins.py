"""Pins: a pinned block is never evicted until it is unpinned; a round that raced a pin rolls back."""

from __future__ import annotations

import threading
from pathlib import Path

from prefixd import Identity, Store
from prefixd.schema.chain import chain_hashes
from prefixd.store import eviction

IDENT = Identity(
    model="m",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=2,
    tenant="a",
)


def prompt(seed: int) -> list[int]:
    return [seed * 10, seed * 10 + 1]


def test_a_pinned_block_outlives_eviction_until_unpinned(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        for seed in range(4):
            store.put(IDENT, prompt(seed), [bytes(4096)])
        pinned = store.pin(IDENT, prompt(0))  # never read again: the first victim by value
        assert pinned.n_blocks == 1
        store.evict(target_bytes=0)
        [kept] = chain_hashes(IDENT, prompt(0))
        assert store.block_info(kept) is not None
        assert store.stats().blocks == 1  # every other block went
        store.unpin(pinned.hashes)
        store.evict(target_bytes=0)
        assert store.block_info(kept) is None


def test_two_pins_need_two_unpins(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        store.put(IDENT, prompt(1), [bytes(100)])
        first = store.pin(IDENT, prompt(1))
        store.pin(IDENT, prompt(1))
        store.unpin(first.hashes)
        store.evict(target_bytes=0)
        assert store.stats().blocks == 1
        store.unpin(first.hashes)
        store.evict(target_bytes=0)
        assert store.stats().blocks == 0


def test_a_pin_of_a_missing_block_pins_nothing(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        assert store.pin(IDENT, prompt(7)).n_blocks == 0
        assert len(store._ctx.pins) == 0


def test_a_round_whose_victim_gets_pinned_rolls_back(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A pin taken while a round runs (after the round chose its victims) wins: the round is
    rolled back and the next one leaves the pinned block alone."""
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        store.put(IDENT, prompt(2), [bytes(100)])
        store.put(IDENT, prompt(3), [bytes(100)])
        [racer] = chain_hashes(IDENT, prompt(2))
        real = eviction.remove_subtree
        pinned = threading.Event()

        def remove_then_pin(ctx, txn, block, *args, **kwargs):  # type: ignore[no-untyped-def]
            removed = real(ctx, txn, block, *args, **kwargs)
            if block == racer and not pinned.is_set():
                pinned.set()
                ctx.pins.hold([racer])  # as a lookup on another thread would, mid-round
            return removed

        monkeypatch.setattr(eviction, "remove_subtree", remove_then_pin)
        store.evict(target_bytes=0)
        assert pinned.is_set()
        assert store.block_info(racer) is not None
        assert store.stats().blocks == 1
