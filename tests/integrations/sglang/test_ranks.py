"""All ranks or none, through SGLang's own storage code (the factory, real CPU host pools and the
controller's backup, hit query and prefetch transfer; harness.py): each rank of a parallel engine
stores its part of every page, and a page is a hit on any rank only while every rank's part is
stored. SGLang decides which ranks write (`HiCacheStorageConfig.is_storage_writer`: every tp rank,
or for an MLA model's pools but Mamba's one per pipeline stage). One writer's backup fails midway
because the daemon goes away while it stores; once the daemon is back, the pages it lacks are
misses on every rank, writer or reader, and the pages every part holds stay hits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolTransfer

from ...daemon.conftest import Daemon
from .harness import (
    PAGE,
    Controller,
    fill,
    host_pool,
    mamba_pool,
    page_hashes,
    pages_of,
    prefixd_extra,
    storage_config,
)
from .test_hybrid import N_PAGES, TRAILING, Pools, extra, query, write

PAGES = 4
TORN_FROM = 2  # the failing writer's store breaks as it reaches this page
TOKENS = torch.randint(
    0, 32000, (PAGES * PAGE,), generator=torch.Generator().manual_seed(3)
).tolist()

LAYOUTS: dict[str, dict[str, Any]] = {
    "tp2": {"tp": 2, "pp": 1, "mla": False},  # a part per tp rank
    "tp2-pp2": {"tp": 2, "pp": 2, "mla": False},  # a part per tp rank and stage
    "mla-tp2": {"tp": 2, "pp": 1, "mla": True},  # one part, shared by both tp ranks
    "mla-tp2-pp2": {"tp": 2, "pp": 2, "mla": True},  # a shared part per stage
}


def ranks(tp: int, pp: int, mla: bool) -> list[dict[str, Any]]:
    return [
        {"tp_rank": t, "tp_size": tp, "pp_rank": p, "pp_size": pp, "mla": mla}
        for p in range(pp)
        for t in range(tp)
    ]


def writes(rank: dict[str, Any]) -> bool:
    """SGLang's own choice of the ranks that back up pages."""
    return bool(storage_config({}, **rank).is_storage_writer)


def gone_at(controller: Controller, page: int, event: Callable[[], None]) -> None:
    """Run `event` (once) as the backend reads host page number `page` to store it: the daemon
    going away in the middle of this rank's backup."""
    pool = controller.pool
    read = pool.get_data_page
    seen: list[int] = []

    def reading(index: Any, flat: bool = True) -> Any:
        seen.append(int(index))
        if len(seen) == page + 1:
            event()
        return read(index, flat)

    pool.get_data_page = reading


def store_parts(daemon: Daemon, layout: str, failing: bool) -> dict[tuple[int, int], list[bytes]]:
    """Every writer backs up its part of the PAGES pages, each from its own host pool; with
    `failing`, the last writer's backup finds the daemon gone from page TORN_FROM on (two pages
    per store call: its first call is stored, its second is not), and the daemon is back after.
    The stored pages by (tp rank, stage) of their writer."""
    writers = [r for r in ranks(**LAYOUTS[layout]) if writes(r)]
    stored = {}
    for i, rank in enumerate(writers):
        pool = host_pool("layer_first")
        page_bytes = int(pool.get_dummy_flat_data_page().nbytes)
        controller = Controller(
            pool, prefixd_extra(daemon.socket, region_bytes=2 * page_bytes), **rank
        )
        slots = controller.pool.alloc(PAGES * PAGE)
        fill(controller.pool, slots, seed=10 + i)
        stored[rank["tp_rank"], rank["pp_rank"]] = pages_of(controller.pool, slots)
        breaks = failing and i == len(writers) - 1
        if breaks:
            gone_at(controller, TORN_FROM, daemon.stop)
        done = controller.backup(TOKENS, slots)
        assert done == (0 if breaks else PAGES * PAGE)  # a batch stored in part counts none
        controller.close()
        if breaks:
            daemon.start()
    return stored


def writer_of(rank: dict[str, Any]) -> tuple[int, int]:
    """Whose part a rank reads: its own, or for MLA its stage's writer's (tp rank 0)."""
    return (0 if rank["mla"] else rank["tp_rank"]), rank["pp_rank"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_writer_whose_backup_failed_midway_makes_its_missing_pages_misses_on_every_rank(
    daemon: Daemon, layout: str
) -> None:
    stored = store_parts(daemon, layout, failing=True)
    for rank in ranks(**LAYOUTS[layout]):
        reader = Controller(host_pool("layer_first"), prefixd_extra(daemon.socket), **rank)
        # the hit query: the pages every part holds, and none past them
        assert reader.hit(TOKENS) == TORN_FROM * PAGE, rank
        slots = reader.pool.alloc(PAGES * PAGE)
        assert reader.prefetch(TOKENS, slots) == TORN_FROM * PAGE, rank
        got = pages_of(reader.pool, slots[: TORN_FROM * PAGE])
        assert got == stored[writer_of(rank)][:TORN_FROM], rank
        # a get without a hit query before it stops at the same page (v1's page get)
        keys = page_hashes(TOKENS)
        fresh = reader.pool.alloc(PAGES * PAGE)
        found = reader.backend.batch_get_v1(keys, fresh, HiCacheStorageExtraInfo(prefix_keys=[]))
        assert found == [i < TORN_FROM for i in range(PAGES)], rank
        reader.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_every_part_holds_are_hits_on_every_rank(daemon: Daemon, layout: str) -> None:
    stored = store_parts(daemon, layout, failing=False)
    for rank in ranks(**LAYOUTS[layout]):
        reader = Controller(host_pool("layer_first"), prefixd_extra(daemon.socket), **rank)
        assert reader.hit(TOKENS) == PAGES * PAGE, rank
        slots = reader.pool.alloc(PAGES * PAGE)
        assert reader.prefetch(TOKENS, slots) == PAGES * PAGE, rank
        assert pages_of(reader.pool, slots) == stored[writer_of(rank)], rank
        reader.close()


def test_v0_pages_follow_the_same_rule(daemon: Daemon) -> None:
    """v0 (flat page tensors, each page a chain of its own): a rank's `batch_exists` and `get`
    of a page whose other part is missing are a miss."""
    extra = prefixd_extra(daemon.socket, interface_v1=0)
    writer = Controller(host_pool("layer_first"), extra, tp_rank=0, tp_size=2)
    slots = writer.pool.alloc(PAGES * PAGE)
    fill(writer.pool, slots, seed=1)
    assert writer.backup(TOKENS, slots) == PAGES * PAGE
    writer.close()
    other = Controller(host_pool("layer_first"), extra, tp_rank=1, tp_size=2)
    slots = other.pool.alloc(PAGES * PAGE)
    fill(other.pool, slots, seed=2)
    assert other.backup(TOKENS[: TORN_FROM * PAGE], slots[: TORN_FROM * PAGE]) == TORN_FROM * PAGE
    other.close()
    keys = page_hashes(TOKENS)
    for tp_rank in (0, 1):
        reader = Controller(host_pool("layer_first"), extra, tp_rank=tp_rank, tp_size=2)
        assert reader.backend.batch_exists(keys) == TORN_FROM
        assert reader.backend.exists(keys[TORN_FROM]) is False
        assert reader.backend.get(keys[0], reader.pool.get_dummy_flat_data_page()) is not None
        assert reader.backend.get(keys[TORN_FROM], reader.pool.get_dummy_flat_data_page()) is None
        reader.close()


def test_v2_trailing_pools_restore_only_where_every_rank_has_its_window(daemon: Daemon) -> None:
    """v2 with a hybrid pool set (test_hybrid.py): a rank's sliding-window checkpoints are its own
    part too. The last window one tp rank stored is missing on the other, so `batch_exists_v2`
    stops at the window both hold; and windows that end at other pages on each rank are restorable
    at none of them (every rank is asked again where another stopped)."""
    keys = page_hashes(list(range(N_PAGES * PAGE)))
    rank = [{"tp_rank": t, "tp_size": 2} for t in range(2)]
    pools = [Pools(seed=20 + t) for t in range(2)]
    backends = [pools[t].backend(prefixd_extra(daemon.socket), **rank[t]) for t in range(2)]
    write(backends[0], pools[0], keys, windows=(3, 5))
    write(backends[1], pools[1], keys, windows=(3,))  # its window at 5 was never stored
    for t in range(2):
        assert query(backends[t], pools[t], keys).kv_hit_pages == 3, t
        window = backends[t].batch_get_v2([pools[t].transfer("swa", 3, 5, keys)], extra(keys[:3]))
        assert window == {"swa": [False, False]}, t
        assert backends[t].batch_get_v2(
            [pools[t].transfer("swa", 1, 3, keys)], extra(keys[:1])
        ) == {"swa": [True, True]}, t
    other = page_hashes(list(range(1, N_PAGES * PAGE + 1)))
    write(backends[0], pools[0], other, windows=(3, 5))
    write(backends[1], pools[1], other, windows=(2, 4))
    for t in range(2):
        assert query(backends[t], pools[t], other).kv_hit_pages == 0, t
    for backend in backends:
        backend.close()


def test_mla_pools_besides_kv_are_the_writers_and_hit_on_every_rank(daemon: Daemon) -> None:
    """An MLA model's indexer and sliding-window pools are, like its KV, backed up by SGLang's
    storage writer alone (`HybridCacheController.should_backup`; every pool but Mamba): every tp
    rank hits them and loads the writer's bytes."""
    keys = page_hashes(list(range(N_PAGES * PAGE)))
    rank = [{"tp_rank": t, "tp_size": 2, "mla": True} for t in range(2)]
    pools = [Pools(seed=20 + t) for t in range(2)]
    backends = [pools[t].backend(prefixd_extra(daemon.socket), **rank[t]) for t in range(2)]
    for t in range(2):
        if writes(rank[t]):
            write(backends[t], pools[t], keys, windows=(3, 5))
    [writer] = [t for t in range(2) if writes(rank[t])]
    for t in range(2):
        assert query(backends[t], pools[t], keys).kv_hit_pages == 5, t
        paged = [pools[t].transfer(name, 0, 5, keys) for name in ("kv", "indexer")]
        got = backends[t].batch_get_v2(paged, extra([]))
        assert got == {"kv": [True] * 5, "indexer": [True] * 5}, t
        window = backends[t].batch_get_v2([pools[t].transfer("swa", 3, 5, keys)], extra(keys[:3]))
        assert window == {"swa": [True] * 2}, t
        for name, first in (("kv", 0), ("indexer", 0), ("swa", 3)):
            assert pools[t].pages(name, first, 5) == pools[writer].pages(name, first, 5), (t, name)
    for backend in backends:
        backend.close()


def test_an_mla_models_mamba_state_stays_a_part_per_tp_rank(daemon: Daemon) -> None:
    """The Mamba state is tp-sharded on an MLA model too, and SGLang backs it up on every rank:
    beside a sliding window (the writer's alone), a boundary restores on every rank only where
    every rank's own state is stored, and each rank loads its own state."""
    rank = [{"tp_rank": t, "tp_size": 2, "mla": True} for t in range(2)]
    pools = [Pools(seed=30 + t) for t in range(2)]
    for t, p in enumerate(pools):
        del p.pools["indexer"], p.slots["indexer"]
        p.pools["mamba"], p.slots["mamba"] = mamba_pool(), torch.tensor([t])
        fill(p.pools["mamba"], p.slots["mamba"], seed=40 + t)
    backends = [pools[t].backend(prefixd_extra(daemon.socket), **rank[t]) for t in range(2)]

    def transfers(t: int, keys: list[str]) -> list[PoolTransfer]:
        """KV pages 0-4, the window of pages 3-4 and the state at page 5, as SGLang sends them."""
        state = PoolTransfer(
            "mamba", host_indices=pools[t].slots["mamba"], keys=keys[4:5], hit_policy=TRAILING
        )
        return [pools[t].transfer("kv", 0, 5, keys), pools[t].transfer("swa", 3, 5, keys), state]

    def store(t: int, keys: list[str], states: bool) -> None:
        kv, window, state = transfers(t, keys)
        if writes(rank[t]):
            assert all(backends[t].batch_set_v2([kv], extra([]))["kv"])
            assert all(backends[t].batch_set_v2([window], extra(keys[:3]))["swa"])
        if states:
            assert backends[t].batch_set_v2([state], extra(keys[:4])) == {"mamba": [True]}

    keys = page_hashes(list(range(N_PAGES * PAGE)))
    other = page_hashes(list(range(1, N_PAGES * PAGE + 1)))
    for t in range(2):
        store(t, keys, states=True)
        store(t, other, states=writes(rank[t]))  # the other rank's state is missing
    for t in range(2):
        hit = backends[t].batch_exists_v2(keys[:5], transfers(t, keys), extra([]))
        assert hit.kv_hit_pages == 5, t
        missing = backends[t].batch_exists_v2(other[:5], transfers(t, other), extra([]))
        assert missing.kv_hit_pages == 0, t
        stored = pools[t].pages("mamba", 0, 1)
        fill(pools[t].pools["mamba"], pools[t].slots["mamba"], seed=50)
        got = backends[t].batch_get_v2([transfers(t, keys)[2]], extra(keys[:4]))
        assert got == {"mamba": [True]} and pools[t].pages("mamba", 0, 1) == stored, t
    for backend in backends:
        backend.close()
