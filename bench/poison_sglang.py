"""The poison suite's SGLang rows: hybrid-model state served from storage after a restart, and
another engine's weights under the same model name, through prefixd's HiCache backend and
SGLang's own file backend (HiCacheFile), both loaded by SGLang's storage factory over real CPU
host pools.

Run in the SGLang venv (.ci/sglang-venv), from the repository root:

    .venv-sglang/bin/python bench/poison_sglang.py [--json]

A hybrid engine here has three host pools: paged KV, a sliding window restored from its last two
pages and a Mamba state (SSM and conv states of every Mamba layer, one per checkpoint), written
and read through the v2 calls as SGLang's hybrid controller makes them. After the restart a fresh
backend over fresh pools asks `batch_exists_v2` for the longest prefix every pool can restore,
then gets each pool there; what it holds is judged against what the writer held at that prefix.

Bit rot: an engine stores a prompt's KV pages, one byte of one stored page flips where the backend
keeps it on disk, and a fresh engine reads the prompt; the right answer is the pages before it.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from tests.integrations.sglang.standin import install

install()  # sglang's model configs import torchvision (see the stand-in's docstring)

import torch
from poisonlib import Outcome, Row, files_under, judge, main, rot, store_files
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
)
from sglang_backend import read, store
from suitelib import SuiteDaemon

from tests.integrations.sglang.harness import (
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

FILE = "SGLang HiCacheFile"
HYBRID = "sglang#39830"
N_PAGES = 6
WIDTH = {"swa": 2, "mamba": 1}  # trailing pools: the pages a checkpoint holds
BOTH = ("swa", "mamba")
PAGED = ("kv", "indexer")  # two paged pools of one class and shape
OTHER_WEIGHTS_PAGES = 4
ROT_PAGES, ROTTEN_PAGE = 4, 2
SSM = torch.bfloat16  # the writer's Mamba SSM state dtype


def _info(prefix: list[str]) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix))


class Hybrid:
    """A hybrid engine's host pools (seeded, or empty for a reader) and the slots its pages and
    states sit in: a KV and a window page per page, a Mamba state per page it may end at."""

    def __init__(self, seed: int | None, ssm_dtype: torch.dtype = SSM) -> None:
        self.pools: dict[str, Any] = {
            "kv": host_pool("layer_first"),
            "swa": host_pool("page_first", layers=1),
            "mamba": mamba_pool(ssm_dtype=ssm_dtype),
        }
        self.slots = {
            name: pool.alloc(N_PAGES * pool.page_size) for name, pool in self.pools.items()
        }
        if seed is None:
            return
        fill(self.pools["kv"], self.slots["kv"], seed)
        fill(self.pools["swa"], self.slots["swa"], seed + 1)
        generator = torch.Generator().manual_seed(seed + 2)
        mamba = self.pools["mamba"]
        size = int(mamba.get_dummy_flat_data_page().numel())
        for slot in self.slots["mamba"].tolist():
            state = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator)
            mamba.set_from_flat_data_page(slot, state)

    def backend(self, extra: dict[str, Any]) -> HiCacheStorage:
        return attach_pools(extra, self.pools)

    def span(self, name: str, end: int) -> tuple[int, torch.Tensor]:
        """The first page of the pool's part of a prefix of `end` pages (a trailing pool: its
        last ones) and the host slots it sits in."""
        first = max(0, end - WIDTH[name]) if name in WIDTH else 0
        page_size = self.pools[name].page_size
        return first, self.slots[name][first * page_size : end * page_size]

    def transfer(self, name: str, end: int, keys: list[str]) -> PoolTransfer:
        first, indices = self.span(name, end)
        return PoolTransfer(
            name=name,
            host_indices=indices,
            keys=keys[first:end],
            hit_policy=PoolHitPolicy.TRAILING_PAGES if name in WIDTH else PoolHitPolicy.ALL_PAGES,
        )

    def write(
        self, backend: HiCacheStorage, keys: list[str], states: Mapping[int, tuple[str, ...]]
    ) -> None:
        """Every KV page, then at each prefix in `states` a checkpoint of the pools it names,
        each carrying the pages before its own (as the hybrid controller writes them)."""
        backend.batch_set_v2([self.transfer("kv", len(keys), keys)], _info([]))
        for end, names in sorted(states.items()):
            for name in names:
                transfer = self.transfer(name, end, keys)
                backend.batch_set_v2([transfer], _info(keys[: end - len(transfer.keys)]))

    def state(self, end: int) -> bytes:
        """What a prefix of `end` pages restores: its KV pages, its window, its Mamba state."""
        return b"".join(
            page
            for name, pool in self.pools.items()
            for page in pages_of(pool, self.span(name, end)[1])
        )

    def restore(self, backend: HiCacheStorage, keys: list[str]) -> tuple[int, bytes | None]:
        """The prefix `batch_exists_v2` reports and the state the gets restore there (None: no
        prefix, or a get failed and the engine recomputes)."""
        query = [self.transfer(name, len(keys), keys) for name in self.pools]
        end = int(backend.batch_exists_v2(keys, query, _info([])).kv_hit_pages)
        if not end:
            return 0, None
        for name in self.pools:
            transfer = self.transfer(name, end, keys)
            got = backend.batch_get_v2([transfer], _info(keys[: end - len(transfer.keys)]))
            if not all(got[name]):
                return end, None
        return end, self.state(end)


def hybrid_case(
    extra: Callable[[], dict[str, Any]],
    restart_store: Callable[[], None],
    seed: int,
    states: Mapping[int, tuple[str, ...]],
    reader_ssm: torch.dtype = SSM,
) -> Outcome:
    """A writer stores a prompt's pools and `states`, the store restarts, a fresh reader (whose
    Mamba SSM state is `reader_ssm`) restores what it is offered; judged against the writer's
    state at that prefix (none is right when the reader's state is another dtype)."""
    keys = page_hashes(list(range(seed, seed + N_PAGES * PAGE)))
    writer = Hybrid(seed)
    backend = writer.backend(extra())
    writer.write(backend, keys, states)
    getattr(backend, "close", lambda: None)()
    restart_store()
    reader = Hybrid(None, reader_ssm)
    fresh = reader.backend(extra())
    end, served = reader.restore(fresh, keys)
    getattr(fresh, "close", lambda: None)()
    complete = end in states and set(states[end]) == set(BOTH)
    expected = writer.state(end) if complete and reader_ssm == SSM else None
    return judge(expected, served)


def other_weights_case(
    extra: dict[str, Any], restart_store: Callable[[], None], seed: int
) -> Outcome:
    """bench/sglang_backend.py's case (b): one engine stores a prompt's KV pages, the store
    restarts, an engine serving other weights under the same model name reads the prompt."""
    tokens, _, _ = store(extra, OTHER_WEIGHTS_PAGES, seed)
    restart_store()
    _, got, _ = read({**extra, "weights": "rev=other-weights"}, tokens, OTHER_WEIGHTS_PAGES)
    return judge(None, b"".join(got) if got else None)


def rotten_case(extra: dict[str, Any], files: Callable[[], Iterable[Path]], seed: int) -> Outcome:
    """An engine stores a prompt's KV pages, a byte of one flips where they lie on disk (`files`),
    a fresh engine reads the prompt: judged against the pages stored, up to what it was served."""
    tokens, expected, _ = store(extra, ROT_PAGES, seed)
    rot(files(), expected[ROTTEN_PAGE])
    _, got, _ = read(extra, tokens, ROT_PAGES)
    return judge(b"".join(expected[: len(got)]), b"".join(got)) if got else "miss"


def same_shape_case(
    extra: Callable[[], dict[str, Any]], restart_store: Callable[[], None], seed: int
) -> Outcome:
    """Two paged pools of one class and shape (the KV and an indexer as large) store a prompt's
    pages under the same page hashes; after the restart a fresh reader gets both pools' pages,
    judged against what the writer held in each."""
    keys = page_hashes(list(range(seed, seed + N_PAGES * PAGE)))
    pools = {name: host_pool("layer_first") for name in PAGED}
    slots = {name: pool.alloc(N_PAGES * PAGE) for name, pool in pools.items()}
    for i, name in enumerate(PAGED):
        fill(pools[name], slots[name], seed + i)
    expected = b"".join(page for name in PAGED for page in pages_of(pools[name], slots[name]))

    def transfers(slots: Mapping[str, torch.Tensor]) -> list[PoolTransfer]:
        return [
            PoolTransfer(
                name=name, host_indices=slots[name], keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES
            )
            for name in PAGED
        ]

    backend = attach_pools(extra(), pools)
    backend.batch_set_v2(transfers(slots), _info([]))
    getattr(backend, "close", lambda: None)()
    restart_store()
    fresh_pools = {name: host_pool("layer_first") for name in PAGED}
    fresh_slots = {name: pool.alloc(N_PAGES * PAGE) for name, pool in fresh_pools.items()}
    fresh = attach_pools(extra(), fresh_pools)
    try:
        if fresh.batch_exists_v2(keys, transfers(fresh_slots), _info([])).kv_hit_pages < N_PAGES:
            return judge(expected, None)
        got = fresh.batch_get_v2(transfers(fresh_slots), _info([]))
        if not all(all(done) for done in got.values()):
            return judge(expected, None)
    finally:
        getattr(fresh, "close", lambda: None)()
    served = b"".join(
        page for name in PAGED for page in pages_of(fresh_pools[name], fresh_slots[name])
    )
    return judge(expected, served)


def rows(root: Path | None = None) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="poison-sglang-") as tmp:
        base = root or Path(tmp)
        daemon = SuiteDaemon(base, "prefixd")
        daemon.start()
        try:
            ours: dict[str, Any] = {
                "extra": lambda: prefixd_extra(daemon.socket),
                "restart_store": daemon.restart,
            }
            theirs: dict[str, Any] = {
                "extra": lambda: file_extra(base / "hicache"),
                "restart_store": lambda: None,  # a new backend reopens the directory
            }
            hybrid = [
                ("hybrid model (KV, window, Mamba state) after a restart", {3: BOTH, 6: BOTH}, SSM),
                ("hybrid model, a store torn before its last Mamba state, after a restart", {3: BOTH, 6: ("swa",)}, SSM),
                ("hybrid model, Mamba SSM state dtype changed across a restart (bf16 to fp16)", {3: BOTH, 6: BOTH}, torch.float16),
            ]  # fmt: skip
            out = []
            for i, (scenario, states, dtype) in enumerate(hybrid):
                seed = 1000 * (i + 1)
                prefixd = hybrid_case(**ours, seed=seed, states=states, reader_ssm=dtype)
                peer = hybrid_case(**theirs, seed=seed, states=states, reader_ssm=dtype)
                out.append(Row(scenario, HYBRID, prefixd, peer, FILE))
            out.append(
                Row(
                    "two paged pools of one shape (KV and an indexer) after a restart",
                    "measured here",
                    same_shape_case(**ours, seed=5000),
                    same_shape_case(lambda: file_extra(base / "hicache-paged"), lambda: None, 5000),
                    FILE,
                )
            )
            v1 = prefixd_extra(daemon.socket, interface_v1=1)
            out.append(
                Row(
                    "another engine's weights under the same model name, after a restart",
                    "measured here (bench/sglang_backend.py)",
                    other_weights_case(v1, ours["restart_store"], seed=7),
                    other_weights_case(file_extra(base / "hicache-mha"), lambda: None, seed=7),
                    FILE,
                )
            )
            out.append(
                Row(
                    "a byte of a stored page flipped on disk (bit rot)",
                    "measured here (bench/sglang_backend.py)",
                    rotten_case(v1, store_files(daemon.data_dir), seed=9),
                    rotten_case(
                        file_extra(base / "hicache-rot"), files_under(base / "hicache-rot"), seed=9
                    ),
                    FILE,
                )
            )
            return out
        finally:
            daemon.close()


if __name__ == "__main__":
    main(rows, __doc__)
