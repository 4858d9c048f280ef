"""Which prefixes a restart warm-up brings back: the most valuable, whole, within the budget."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from prefixd import Identity, Store
from prefixd.clock import ManualClock
from prefixd.schema.state import StateGroup

SIZE = 100


def prompt(seed: int, n_blocks: int, block_tokens: int) -> np.ndarray:
    return np.arange(n_blocks * block_tokens, dtype=np.uint32) + seed * 10_000


def test_hot_prefixes_are_whole_and_fit_the_budget(tmp_path: Path, identity: Identity) -> None:
    bt = identity.block_tokens
    shared = prompt(1, 2, bt)
    hot_a = np.concatenate([shared, prompt(2, 2, bt)])  # 2 shared blocks + 2 of its own
    hot_b = np.concatenate([shared, prompt(3, 1, bt)])  # the same 2 shared + 1
    cold = prompt(4, 3, bt)
    clock = ManualClock()
    with Store.open(tmp_path / "s", map_size=64 << 20, clock=clock) as store:
        for tokens in (hot_a, hot_b, cold):
            store.put(identity, tokens, [bytes(SIZE)] * (len(tokens) // bt))
        clock.advance(0.01)
        for _ in range(10):
            store.longest_prefix(identity, hot_a)
            store.longest_prefix(identity, hot_b)
        # 5 blocks: the shared 2 once, then the rest of both hot prompts; the cold one is left
        found = store.hottest(5 * SIZE, tenant="a")
        assert sorted(p.tokens for p in found) == sorted([hot_a.tobytes(), hot_b.tobytes()])
        assert all(p.identity == identity for p in found)
        assert [len(p.payload_sizes) for p in sorted(found, key=lambda p: len(p.tokens))] == [3, 4]
        assert found[0].score >= found[1].score
        # a smaller budget takes what fits, never a block without its ancestors
        small = store.hottest(3 * SIZE, tenant="a")
        assert [p.payload_bytes for p in small] == [3 * SIZE]
        assert store.hottest(SIZE // 2, tenant="a") == []
        assert len(store.hottest(100 * SIZE, tenant="a", limit=1)) == 1
        # each prefix is whole (the shared blocks are in both): 4 + 3 + 3 blocks
        assert sum(p.payload_bytes for p in store.hottest(100 * SIZE, tenant="a")) == 10 * SIZE


def test_only_the_tenants_plain_prefixes(tmp_path: Path, identity: Identity) -> None:
    bt = identity.block_tokens
    hybrid = dataclasses.replace(identity, state=(StateGroup.paged("kv"),))
    shared = dataclasses.replace(identity, tenant="b")
    with Store.open(tmp_path / "s", map_size=64 << 20, share_groups=("g=b+c",)) as store:
        store.put_state(hybrid, prompt(1, 2, bt), paged={"kv": [b"x" * SIZE] * 2})
        store.put(shared, prompt(2, 2, bt), [bytes(SIZE)] * 2)
        store.put(identity, prompt(3, 1, bt), [bytes(SIZE)])
        assert [p.identity for p in store.hottest(1 << 20, tenant="a")] == [identity]
        # a tenant of a share group warms the group's prefixes, named as its own
        [mine] = store.hottest(1 << 20, tenant="c")
        assert mine.identity == dataclasses.replace(shared, tenant="c")
        assert store.hottest(1 << 20, tenant="nobody") == []
