"""Eviction: leaves only, value per byte (or LRU) order, capacity held, a full map never fatal."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np

from prefixd import Identity, Store
from prefixd.schema.chain import chain_hashes
from prefixd.store import PurgeSelector

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


def chain(seed: int, n_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(2 * n_blocks)]


def test_leaves_go_first_and_everything_left_is_reachable(tmp_path: Path) -> None:
    rnd = random.Random(5)
    with Store.open(tmp_path / "s", capacity_bytes=200_000, map_size=8 << 20) as store:
        prompts = []
        for step in range(300):
            if prompts and rnd.random() < 0.4:
                base = rnd.choice(prompts)
                prompt = base[: 2 * rnd.randrange(1, len(base) // 2 + 1)] + chain(step, 3)
            else:
                prompt = chain(step, rnd.randrange(1, 6))
            have = store.longest_prefix(IDENT, prompt).n_blocks
            n = len(prompt) // 2
            store.put(IDENT, prompt, [bytes(1000 + step)] * (n - have), first_block=have)
            prompts.append(prompt)
            if rnd.random() < 0.3:
                store.longest_prefix(IDENT, rnd.choice(prompts))
            assert store.stats().stored_bytes <= 200_000
        assert store.check() == []  # no orphans: every stored block's parent is stored
        assert store.stats().blocks > 0


def put_leaf(store: Store, seed: int, size: int) -> bytes:
    prompt = chain(seed, 1)
    store.put(IDENT, prompt, [bytes(size)])
    return chain_hashes(IDENT, prompt)[0]


def test_value_per_byte_order(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        cold = put_leaf(store, 1, 4096)
        hot = put_leaf(store, 2, 4096)
        big = put_leaf(store, 3, 40_960)
        for _ in range(20):
            store.longest_prefix(IDENT, chain(2, 1))
            store.longest_prefix(IDENT, chain(3, 1))
        store.evict(target_bytes=4096 + 40_960)  # room for two of the three
        assert store.block_info(cold) is None  # never read: lowest value
        assert store.block_info(hot) is not None and store.block_info(big) is not None
        store.evict(target_bytes=4096)
        assert store.block_info(big) is None  # as hot, but ten times the bytes
        assert store.block_info(hot) is not None


def test_a_parent_outlives_its_children(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        prompt = chain(1, 3)
        # by value per byte the parent (most bytes) would go first; leaf-first says otherwise
        store.put(IDENT, prompt, [bytes(10_000), bytes(1_000), bytes(100)])
        parent, middle, leaf = chain_hashes(IDENT, prompt)
        for _ in range(5):
            store.longest_prefix(IDENT, prompt)
        store.evict(target_bytes=11_000)
        assert store.block_info(leaf) is None
        assert store.block_info(middle) is not None and store.block_info(parent) is not None
        store.evict(target_bytes=10_000)
        assert store.block_info(middle) is None and store.block_info(parent) is not None
        store.evict(target_bytes=0)
        assert store.stats().blocks == 0


def test_lru_order(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", map_size=64 << 20, eviction="lru") as store:
        old = put_leaf(store, 1, 1000)
        new = put_leaf(store, 2, 1000)
        store.longest_prefix(IDENT, chain(1, 1))  # now block 1 was read last
        store.evict(target_bytes=1000)
        assert store.block_info(new) is None and store.block_info(old) is not None


def test_a_full_map_evicts_instead_of_failing(tmp_path: Path) -> None:
    """Capacity above what the map can hold: puts keep succeeding by evicting, and the data file
    stops growing because freed pages are reused."""
    path = tmp_path / "s"
    rng = np.random.default_rng(0)
    sizes = []
    with Store.open(path, map_size=4 << 20, capacity_bytes=4 << 20) as store:
        for step in range(120):
            payloads = [rng.integers(0, 256, 128 << 10, dtype=np.uint8).tobytes()] * 2
            store.put(IDENT, chain(step, 2), payloads)
            sizes.append((path / "data.mdb").stat().st_size)
        assert store.longest_prefix(IDENT, chain(119, 2)).n_blocks == 2  # the newest is stored
        assert store.check() == []
    assert sizes[-1] <= 4 << 20 and sizes[-1] == sizes[-40]


def tenant(name: str) -> Identity:
    return Identity(**{**IDENT.to_dict(), "tenant": name})


def test_a_tenant_over_its_quota_evicts_its_own_blocks_only(tmp_path: Path) -> None:
    quota = 20_000
    with Store.open(tmp_path / "s", map_size=64 << 20, tenant_quota_bytes=quota) as store:
        store.put(tenant("quiet"), chain(0, 5), [bytes(1000)] * 5)
        for step in range(1, 60):
            store.put(tenant("noisy"), chain(step, 2), [bytes(1000)] * 2)
            assert store.tenant_bytes("noisy") <= quota * 0.95
        assert store.longest_prefix(tenant("quiet"), chain(0, 5)).n_blocks == 5
        assert store.tenant_bytes("quiet") == 5000
        assert store.longest_prefix(tenant("noisy"), chain(59, 2)).n_blocks == 2  # newest kept
        assert store.check() == []  # per-identity counters agree with the tables
        store.purge(PurgeSelector(tenant="noisy"))
        assert store.tenant_bytes("noisy") == 0


def test_a_put_past_its_tenants_quota_and_the_capacity_evicts_its_tenants_blocks_first(
    tmp_path: Path,
) -> None:
    """The quota is weighed before the capacity: a tenant's put that takes both past their limit
    pays with its own blocks, and others' older blocks stay while that made room enough."""
    with Store.open(
        tmp_path / "s",
        map_size=64 << 20,
        capacity_bytes=20_000,
        tenant_quotas=("noisy=10000",),
        eviction="lru",
    ) as store:
        store.put(tenant("quiet"), chain(0, 8), [bytes(1000)] * 8)  # the least recently read
        store.put(tenant("noisy"), chain(1, 12), [bytes(1000)] * 12)
        assert store.tenant_bytes("quiet") == 8000
        assert store.tenant_bytes("noisy") <= 10_000 * 0.95
        assert store.check() == []


def test_tenant_bytes_follow_puts_and_removals(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        lora = Identity(**{**IDENT.to_dict(), "adapter": "lora@1"})
        store.put(IDENT, chain(1, 3), [bytes(100)] * 3)
        store.put(lora, chain(1, 2), [bytes(50)] * 2)
        assert store.tenant_bytes("a") == 400
        store.delete([store.longest_prefix(IDENT, chain(1, 3)).hashes[1]])
        assert store.tenant_bytes("a") == 200
        assert store.tenant_bytes("nobody") == 0


def test_a_tenant_quota_overrides_the_default(tmp_path: Path) -> None:
    with Store.open(
        tmp_path / "s",
        map_size=64 << 20,
        tenant_quota_bytes=50_000,
        tenant_quotas=("small=8000",),
    ) as store:
        for step in range(1, 30):
            store.put(tenant("small"), chain(step, 1), [bytes(1000)])
            store.put(tenant("big"), chain(step, 1), [bytes(1000)])
        assert store.tenant_bytes("small") <= 8000 * 0.95
        assert store.tenant_bytes("big") == 29_000  # under its (default) quota: nothing evicted


def test_eviction_order_matches_a_reference_model(tmp_path: Path) -> None:
    """Independent leaves of well-separated value per byte: the store evicts exactly the ones a
    direct computation of the documented estimator ranks lowest."""
    import math

    from prefixd.store.eviction import IDLE_TAU_S, TAU_S

    rnd = random.Random(3)
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        leaves = []
        for seed in range(1, 31):
            size = 1000 * rnd.choice((1, 4, 16))
            hits = rnd.choice((0, 3, 30))
            block = put_leaf(store, seed, size)
            for _ in range(hits):
                store.longest_prefix(IDENT, chain(seed, 1))
            leaves.append(block)
        store.sync()
        now = __import__("time").time_ns()

        def value(block: bytes) -> float:
            info = store.block_info(block)
            assert info is not None
            residence = (now - info.created_ns) / 1e9
            idle = (now - info.last_access_ns) / 1e9
            rate = (info.hits + 1) / (residence + TAU_S) * math.exp(-idle / IDLE_TAU_S)
            return rate * info.n_tokens / info.stored_size

        ranked = sorted(leaves, key=value)
        total = sum(store.block_info(b).stored_size for b in leaves)  # type: ignore[union-attr]
        target = total // 2
        expected_gone, freed = set(), 0
        for block in ranked:
            if total - freed <= target:
                break
            expected_gone.add(block)
            freed += store.block_info(block).stored_size  # type: ignore[union-attr]
        store.evict(target_bytes=target)
        gone = {b for b in leaves if store.block_info(b) is None}
        assert gone == expected_gone
