"""v2 (`PoolTransfer` per pool) for a hybrid pool set, through real CPU host pools: the KV pool,
an indexer pool needed for every page (ALL_PAGES) and a sliding-window pool restored from its
last two pages (TRAILING_PAGES), written and queried as SGLang's hybrid controller does (each
trailing store carries the pages before its keys in prefix_keys)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
)

from prefixd.client import Client
from prefixd.errors import ConfigError
from prefixd.integrations.sglang.backend import PrefixdHiCache
from prefixd.integrations.sglang.identity import _joined

from ...daemon.conftest import Daemon
from ...store.test_faults import corrupt_payload
from .harness import (
    PAGE,
    attach_pools,
    file_extra,
    fill,
    host_pool,
    mamba_pool,
    page_hashes,
    pages_of,
    prefixd_extra,
)

N_PAGES = 6
WINDOW = 2  # the sliding-window pool keeps its last two pages
ALL, TRAILING = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES


class Pools:
    """A hybrid engine's host pools and the slots its pages sit in."""

    def __init__(self, seed: int | None) -> None:
        self.pools = {
            "kv": host_pool("layer_first"),
            "indexer": host_pool("layer_first", layers=1),
            "swa": host_pool("page_first", layers=1),
        }
        self.slots = {name: pool.alloc(N_PAGES * PAGE) for name, pool in self.pools.items()}
        if seed is not None:
            for i, (name, pool) in enumerate(self.pools.items()):
                fill(pool, self.slots[name], seed + i)

    def backend(self, extra: dict[str, Any], **ranks: Any) -> HiCacheStorage:
        """`ranks`: the storage config's tp_rank, tp_size, ..."""
        return attach_pools(extra, self.pools, **ranks)

    def transfer(self, name: str, first: int, end: int, keys: list[str]) -> PoolTransfer:
        policy = TRAILING if name == "swa" else ALL
        indices = self.slots[name][first * PAGE : end * PAGE]
        return PoolTransfer(
            name=name, host_indices=indices, keys=keys[first:end], hit_policy=policy
        )

    def pages(self, name: str, first: int, end: int) -> list[bytes]:
        return pages_of(self.pools[name], self.slots[name][first * PAGE : end * PAGE])


def extra(prefix: list[str]) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix))


def write(
    backend: HiCacheStorage,
    pools: Pools,
    keys: list[str],
    *,
    indexer_pages: int = N_PAGES,
    windows: tuple[int, ...] = (3, 5),
) -> None:
    """The paged pools' pages, then a window checkpoint at each boundary in `windows`."""
    result = backend.batch_set_v2(
        [pools.transfer("kv", 0, N_PAGES, keys), pools.transfer("indexer", 0, indexer_pages, keys)],
        extra([]),
    )
    assert all(result["kv"]) and all(result["indexer"])
    for end in windows:
        window = backend.batch_set_v2(
            [pools.transfer("swa", end - WINDOW, end, keys)], extra(keys[: end - WINDOW])
        )
        assert window == {"swa": [True] * WINDOW}


def query(backend: HiCacheStorage, pools: Pools, keys: list[str]) -> Any:
    transfers = [
        pools.transfer("kv", 0, N_PAGES, keys),
        pools.transfer("indexer", 0, N_PAGES, keys),
        pools.transfer("swa", N_PAGES - WINDOW, N_PAGES, keys),
    ]
    return backend.batch_exists_v2(keys, transfers, extra([]))


def joint_pages(daemon: Daemon, backend: PrefixdHiCache, keys: list[str]) -> int:
    """prefixd's own joint rule over the chain, asked directly of the daemon."""
    identity = backend._trailing_identity()
    with Client(daemon.socket) as client:
        [hit] = client.lookup_state(identity, [b"".join(bytes.fromhex(k) for k in keys)])
    return hit.reusable_tokens // 8


def test_exists_v2_is_prefixds_joint_boundary_and_v2_round_trips_across_a_restart(
    daemon: Daemon, tmp_path: Path
) -> None:
    keys = page_hashes(list(range(N_PAGES * PAGE)))
    writer = Pools(seed=1)
    backend = writer.backend(prefixd_extra(daemon.socket))
    write(backend, writer, keys)
    # windows end at pages 3 and 5: 6 pages of KV and indexer, restorable at 5 at most
    hit = query(backend, writer, keys)
    assert hit.kv_hit_pages == 5 == joint_pages(daemon, backend, keys)
    assert hit.restorable_prefix_pages == [5]
    # SGLang's own file backend, given the same calls, reports the same longest prefix
    reference = Pools(seed=1).backend(file_extra(tmp_path / "hicache"))
    write(reference, writer, keys)
    assert query(reference, writer, keys).kv_hit_pages == 5
    backend.close()

    daemon.restart()
    reader = Pools(seed=None)
    fresh = reader.backend(prefixd_extra(daemon.socket))
    assert query(fresh, reader, keys).kv_hit_pages == 5
    got = fresh.batch_get_v2(
        [reader.transfer("kv", 0, 5, keys), reader.transfer("indexer", 0, 5, keys)], extra([])
    )
    assert got == {"kv": [True] * 5, "indexer": [True] * 5}
    window = fresh.batch_get_v2([reader.transfer("swa", 3, 5, keys)], extra(keys[:3]))
    assert window == {"swa": [True, True]}
    for name, first in (("kv", 0), ("indexer", 0), ("swa", 3)):
        assert reader.pages(name, first, 5) == writer.pages(name, first, 5)
    # no window ends at 6: its get is refused whole, nothing is claimed
    assert fresh.batch_get_v2([reader.transfer("swa", 4, 6, keys)], extra(keys[:4])) == {
        "swa": [False, False]
    }


def test_exists_v2_never_reports_more_than_every_pool_supports(daemon: Daemon) -> None:
    keys = page_hashes(list(range(N_PAGES * PAGE)))
    pools = Pools(seed=2)
    backend = pools.backend(prefixd_extra(daemon.socket))
    # the indexer has pages 0..3 only: the window at 5 is past it, the one at 3 is the answer
    write(backend, pools, keys, indexer_pages=4)
    hit = query(backend, pools, keys)
    assert hit.kv_hit_pages == 3
    assert hit.extra_pool_hit_pages["indexer"] == 4
    assert hit.restorable_prefix_pages == [3]
    # no window at all: nothing is restorable
    other = page_hashes(list(range(1, N_PAGES * PAGE + 1)))
    write(backend, pools, other, windows=())
    assert query(backend, pools, other).kv_hit_pages == 0
    # paged pools alone: every prefix of their common boundary is restorable
    paged = [pools.transfer("kv", 0, N_PAGES, keys), pools.transfer("indexer", 0, N_PAGES, keys)]
    alone = backend.batch_exists_v2(keys, paged, extra([]))
    assert (alone.kv_hit_pages, alone.restorable_prefix_pages) == (4, [1, 2, 3, 4])


@pytest.mark.damages_store
def test_a_corrupted_window_moves_the_boundary_back(daemon: Daemon) -> None:
    keys = page_hashes(list(range(N_PAGES * PAGE)))
    pools = Pools(seed=3)
    backend = pools.backend(prefixd_extra(daemon.socket))
    write(backend, pools, keys)
    backend.close()
    daemon.stop()
    corrupt_payload(daemon.data_dir, b"".join(pools.pages("swa", 3, 5)))
    daemon.start()
    fresh = Pools(seed=None)
    reader = fresh.backend(prefixd_extra(daemon.socket))
    assert reader.batch_get_v2([fresh.transfer("swa", 3, 5, keys)], extra(keys[:3])) == {
        "swa": [False, False]
    }
    assert query(reader, fresh, keys).kv_hit_pages == 3  # the window at 3 is intact


def test_block_groups_are_refused_clearly(daemon: Daemon) -> None:
    pools = Pools(seed=None)
    config = prefixd_extra(daemon.socket, pools={"indexer": "block_groups"})
    with pytest.raises(ConfigError, match="BLOCK_GROUPS"):
        pools.backend(config)
    backend = pools.backend(prefixd_extra(daemon.socket))
    keys = page_hashes(list(range(N_PAGES * PAGE)))
    grouped = pools.transfer("indexer", 0, N_PAGES, keys)
    grouped.hit_policy = PoolHitPolicy.BLOCK_GROUPS
    with pytest.raises(ConfigError, match="BLOCK_GROUPS"):
        backend.batch_exists_v2(keys, [grouped], extra([]))
    wrong = pools.transfer("swa", 0, 2, keys)
    wrong.hit_policy = ALL  # served as trailing pages: another policy is refused, not guessed
    with pytest.raises(ConfigError, match="trailing_pages"):
        backend.batch_set_v2([wrong], extra([]))


def test_a_mamba_state_of_another_dtype_or_shape_is_another_identity(daemon: Daemon) -> None:
    """A Mamba pool's `dtype` is its conv states' and its page size a sum: an engine restarted
    with another SSM state dtype (or shape) of the same size must not be served the old states
    (bench/poison_sglang.py's row of sglang#39830)."""

    def identity(**state: Any) -> Any:
        pools = {"kv": host_pool("layer_first"), "mamba": mamba_pool(**state)}
        backend = attach_pools(prefixd_extra(daemon.socket), pools)
        try:
            return backend._trailing_identity()
        finally:
            backend.close()

    bf16 = identity(ssm_dtype=torch.bfloat16)
    assert identity(ssm_dtype=torch.bfloat16) == bf16
    assert identity(ssm_dtype=torch.float16) != bf16
    assert identity(ssm_dtype=torch.bfloat16, ssm_shape=(16, 4, 16)) != bf16


def test_a_local_models_preprocessing_files_edited_in_place_are_a_miss(
    daemon: Daemon, tmp_path: Path
) -> None:
    """SGLang hashes an image by its data: an image processor's config edited in place (another
    normalization, the same pad tokens) makes other embeddings under the same page hashes, so
    every pool, the trailing one too, misses."""
    model = tmp_path / "model"
    model.mkdir()
    processor = model / "preprocessor_config.json"
    processor.write_text('{"image_mean": [0.5, 0.5, 0.5]}')
    keys = page_hashes(list(range(N_PAGES * PAGE)))
    pools = Pools(seed=5)
    backend = pools.backend(prefixd_extra(daemon.socket), model=str(model))
    write(backend, pools, keys)
    assert query(backend, pools, keys).kv_hit_pages == 5
    trailing = backend._trailing_identity()
    backend.close()
    processor.write_text('{"image_mean": [0.48, 0.46, 0.41]}')
    edited = pools.backend(prefixd_extra(daemon.socket), model=str(model))
    assert query(edited, pools, keys).kv_hit_pages == 0
    assert joint_pages(daemon, edited, keys) == 0
    assert edited._trailing_identity().mm is None  # its chain cannot name the items
    assert edited._trailing_identity().kv_layout != trailing.kv_layout
    edited.close()


def test_paged_pools_of_one_shape_keep_their_own_pages(daemon: Daemon) -> None:
    """Two paged pools of the same class and shape (an indexer as large as the KV) are stored
    under the same page hashes: each pool's name is part of its identity, so each reads back its
    own bytes, never the other's."""
    keys = page_hashes(list(range(N_PAGES * PAGE)))

    def pools(seed: int | None) -> Pools:
        made = Pools(seed=None)
        made.pools["indexer"] = host_pool("layer_first")  # as the KV pool is made
        made.slots["indexer"] = made.pools["indexer"].alloc(N_PAGES * PAGE)
        if seed is not None:
            for i, name in enumerate(("kv", "indexer")):
                fill(made.pools[name], made.slots[name], seed + i)
        return made

    writer = pools(seed=4)
    assert writer.pages("kv", 0, N_PAGES) != writer.pages("indexer", 0, N_PAGES)
    backend = writer.backend(prefixd_extra(daemon.socket))
    write(backend, writer, keys, windows=())
    backend.close()
    reader = pools(seed=None)
    fresh = reader.backend(prefixd_extra(daemon.socket))
    got = fresh.batch_get_v2(
        [reader.transfer(name, 0, N_PAGES, keys) for name in ("kv", "indexer")], extra([])
    )
    assert got == {"kv": [True] * N_PAGES, "indexer": [True] * N_PAGES}
    for name in ("kv", "indexer"):
        assert reader.pages(name, 0, N_PAGES) == writer.pages(name, 0, N_PAGES), name
    fresh.close()


def test_a_layout_key_given_twice_is_refused() -> None:
    """A pool's layout joined with its name or ranks: a key in both would silently keep one value
    (a pool's name was once lost so), so it is refused."""
    with pytest.raises(ValueError, match=r"given twice: \['pool'\]"):
        _joined({"pool": "indexer"}, {"pool": "MHATokenToKVPoolHost", "dtype": "bfloat16"})
    assert _joined({"pool": "kv"}, {"class": "MHATokenToKVPoolHost"}) == (
        '{"class":"MHATokenToKVPoolHost","pool":"kv"}'
    )
