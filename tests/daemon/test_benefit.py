"""The benefit rule: a hit is offered for loading only where loading it costs less than the
prefill it saves. With an injected fast prefill (the daemon's setting, or what an engine reports
with its lookups) or an injected slow store (the learned load time), lookups hold hits back,
`load_into` and `warm_up` recompute instead of loading, and the daemon counts what it skipped
and the net seconds its loads saved, per tenant."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixd import Store
from prefixd.client import Client
from prefixd.clock import ManualClock
from prefixd.daemon.benefit import LOAD_IDLE_S, PrefillRates
from prefixd.daemon.metrics import Metrics
from prefixd.daemon.services import Services

from .conftest import IDENTITY, Daemon, DaemonFactory, make_identity, payload
from .test_loop_work import services

BT = IDENTITY.block_tokens
SIZE = 1000
N_BLOCKS = 8
FAST_PREFILL = "1e9"  # tokens/s: no load is worth it against such a prefill


def tokens(n: int, seed: int = 1) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) * 13 + seed * 1_000_003 + 600_000_000).astype(np.uint32)


def stored_prompt(daemon: Daemon, identity: object = IDENTITY, seed: int = 1) -> np.ndarray:
    prompt = tokens(N_BLOCKS * BT, seed)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        stored = client.put(identity, prompt, [payload(seed, i, SIZE) for i in range(N_BLOCKS)])
        assert stored.stored == N_BLOCKS
    return prompt


def tenant_metrics(client: Client, tenant: str) -> dict[str, float]:
    tenants: dict[str, dict[str, float]] = client.stats()["metrics"]["tenants"]
    return tenants[tenant]


def test_a_fast_prefill_holds_every_hit_back_and_the_daemon_counts_it(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory("--prefill-tokens-per-s", FAST_PREFILL)
    prompt = stored_prompt(daemon)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        [hit] = client.lookup(IDENTITY, [prompt])
        assert (hit.n_blocks, hit.n_tokens, hit.sizes) == (0, 0, ())
        assert hit.withheld_tokens == N_BLOCKS * BT
        assert hit.est_load_s > hit.est_prefill_s > 0  # the estimates of the hit found
        destinations = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(N_BLOCKS)]
        installed = client.load_into(IDENTITY, prompt, destinations)
        assert (installed.n_blocks, installed.n_tokens, installed.n_bytes) == (0, 0, 0)
        assert installed.withheld_tokens == N_BLOCKS * BT  # recomputed by choice, not missed
        assert not any(d.any() for d in destinations)
        counted = tenant_metrics(client, IDENTITY.tenant)
        assert counted["loads_skipped"] == 2 and counted["lookup_hits"] == 0
        assert counted["loaded_tokens"] == 0
        # a direct load is the engine's own decision: it is served
        assert client.load(IDENTITY, prompt).n_blocks == N_BLOCKS


def test_an_engines_reported_prefill_decides_for_its_tenant_only(daemon: Daemon) -> None:
    other = make_identity(tenant="b")
    prompt, theirs = stored_prompt(daemon), stored_prompt(daemon, other, seed=2)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        [fast] = client.lookup(IDENTITY, [prompt], prefill_tokens_per_s=1e12)
        assert fast.n_blocks == 0 and fast.withheld_tokens == N_BLOCKS * BT
        [later] = client.lookup(IDENTITY, [prompt])  # the tenant's engines were measured fast
        assert later.n_blocks == 0
        [slow] = client.lookup(IDENTITY, [prompt], prefill_tokens_per_s=1.0)
        assert slow.n_blocks == N_BLOCKS and slow.withheld_tokens == 0
        [unaffected] = client.lookup(other, [theirs])  # another tenant's prefill is its own
        assert unaffected.n_blocks == N_BLOCKS
        assert tenant_metrics(client, IDENTITY.tenant)["loads_skipped"] == 2
        assert tenant_metrics(client, other.tenant).get("loads_skipped", 0) == 0


def test_a_report_counts_once_per_lookup_and_is_held_to_the_settings_bounds(
    daemon: Daemon,
) -> None:
    """A lookup of many prompts is one report of its engine's throughput, not one per prompt; a
    throughput no engine has (5e-324 tokens/s) is held to the setting's bounds, so no estimate,
    and no total of the node's, turns infinite."""
    prompt, n = stored_prompt(daemon), N_BLOCKS * BT
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.lookup(IDENTITY, [prompt], prefill_tokens_per_s=1000.0)
        client.lookup(IDENTITY, [prompt] * 64, prefill_tokens_per_s=1e9)
        [hit] = client.lookup(IDENTITY, [prompt])
        assert hit.est_prefill_s == pytest.approx(n / (0.8 * 1000 + 0.2 * 1e9), rel=1e-3)
        [tiny] = client.lookup(IDENTITY, [prompt], prefill_tokens_per_s=5e-324)
        assert tiny.est_prefill_s == pytest.approx(n / 1.0)
        client.load(IDENTITY, prompt)
        totals = client.stats()["metrics"]["totals"]
    assert all(math.isfinite(value) for value in totals.values()), totals


def test_a_slow_store_makes_hits_not_worth_loading(tmp_path: Path) -> None:
    """The learned load time: once the daemon has seen its loads crawl, the same hit that paid
    is held back, and those loads count against the prefill they saved."""
    bt = IDENTITY.block_tokens
    prompt = np.arange(N_BLOCKS * bt, dtype=np.uint32) + 5
    with Store.open(tmp_path / "s", map_size=64 << 20) as store, ThreadPoolExecutor(1) as pool:
        store.put(IDENTITY, prompt, [b"k" * SIZE] * N_BLOCKS)
        shared = services(store, pool)
        match = store.longest_prefix(IDENTITY, prompt)
        [before], _ = shared.lookup_results(IDENTITY, [(prompt.tobytes(), None)], [match])
        assert before.n_blocks == N_BLOCKS
        for i in range(16):  # loads of two sizes at 1 KB/s
            size = SIZE * (1 + i % 2)
            shared.metrics.observe_load(IDENTITY.tenant, bt, size, seconds=size / 1000)
        [after], observed = shared.lookup_results(IDENTITY, [(prompt.tobytes(), None)], [match])
        assert after.n_blocks == 0 and after.withheld_tokens == N_BLOCKS * bt
        assert after.est_load_s == pytest.approx(N_BLOCKS * SIZE / 1000, rel=0.01)
        assert observed[0].skipped
        mine = shared.metrics.snapshot()["tenants"][IDENTITY.tenant]
        assert mine["net_saved_seconds"] < 0 < mine["prefill_saved_seconds"]


def test_one_tenants_odd_loads_never_hold_back_anothers_hits(tmp_path: Path) -> None:
    """Loads of one-byte blocks that take a second each fit a line of a few bytes per second: the
    loading tenant's own hits are judged by it, another tenant's are not."""
    bt = IDENTITY.block_tokens
    prompt = np.arange(N_BLOCKS * bt, dtype=np.uint32) + 5
    odd = make_identity(tenant="odd")
    with Store.open(tmp_path / "s", map_size=64 << 20) as store, ThreadPoolExecutor(1) as pool:
        store.put(IDENTITY, prompt, [b"k" * SIZE] * N_BLOCKS)
        store.put(odd, prompt, [b"k" * SIZE] * N_BLOCKS)
        shared = services(store, pool)
        for i in range(16):
            shared.metrics.observe_load(odd.tenant, bt, 1 + i % 2, seconds=1.0 + i % 2)

        def offered(identity: object) -> int:
            match = store.longest_prefix(identity, prompt)  # type: ignore[arg-type]
            key = (prompt.tobytes(), None)
            [result], _ = shared.lookup_results(identity, [key], [match])  # type: ignore[arg-type]
            return result.n_blocks

        assert offered(odd) == 0  # its own loads crawled
        assert offered(IDENTITY) == N_BLOCKS
        tenants = shared.metrics.snapshot()["tenants"]
        assert tenants[odd.tenant]["load_bandwidth_gbps"] < 1e-6
        assert "load_bandwidth_gbps" not in tenants[IDENTITY.tenant]  # no loads: the defaults


def test_a_load_time_no_load_reached_for_a_while_is_forgotten(tmp_path: Path) -> None:
    """A hit the model holds back is not loaded, so the model would never see a faster load
    again: once no load reached it for LOAD_IDLE_S, hits are offered and measured afresh."""
    bt = IDENTITY.block_tokens
    prompt = np.arange(N_BLOCKS * bt, dtype=np.uint32) + 5
    clock = ManualClock()
    with Store.open(tmp_path / "s", map_size=64 << 20) as store, ThreadPoolExecutor(1) as pool:
        store.put(IDENTITY, prompt, [b"k" * SIZE] * N_BLOCKS)
        metrics = Metrics(store, prefill_tokens_per_s=1e4, clock=clock)
        shared = Services(
            store=store,
            pool=pool,
            metrics=metrics,
            max_frame_bytes=1 << 20,
            max_region_bytes=1 << 20,
            clock=clock,
        )
        match = store.longest_prefix(IDENTITY, prompt)

        def offered() -> int:
            [result], _ = shared.lookup_results(IDENTITY, [(prompt.tobytes(), None)], [match])
            return result.n_blocks

        for i in range(16):  # a while of loads at 1 KB/s
            size = SIZE * (1 + i % 2)
            metrics.observe_load(IDENTITY.tenant, bt, size, seconds=size / 1000)
        assert offered() == 0
        clock.advance(LOAD_IDLE_S - 1)
        assert offered() == 0
        clock.advance(1)
        assert offered() == N_BLOCKS


def test_warm_up_skips_prefixes_not_worth_loading(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--prefill-tokens-per-s", FAST_PREFILL)
    stored_prompt(daemon)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        warmed = client.warm_up(
            1 << 20,
            lambda prefix: [torch.zeros(SIZE, dtype=torch.uint8) for _ in prefix.sizes],
            tenant=IDENTITY.tenant,
        )
        assert (warmed.prefixes, warmed.blocks, warmed.skipped) == (0, 0, 1)


def test_the_net_seconds_saved_are_the_prefill_saved_less_the_loads(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory("--prefill-tokens-per-s", "1000")
    prompt = stored_prompt(daemon)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        destinations = [torch.zeros(SIZE, dtype=torch.uint8) for _ in range(N_BLOCKS)]
        assert client.load_into(IDENTITY, prompt, destinations).n_blocks == N_BLOCKS
        counted = tenant_metrics(client, IDENTITY.tenant)
    saved = counted["prefill_saved_seconds"]
    assert saved == pytest.approx(N_BLOCKS * BT / 1000)
    assert 0 < saved - counted["net_saved_seconds"] < saved  # the loads took some time
    assert counted["loads_skipped"] == 0


def test_a_tenants_reported_prefill_is_an_average_and_forgotten_last() -> None:
    rates = PrefillRates(configured=100.0)
    assert rates.of("a") == 100.0
    rates.report("a", 1000.0)
    rates.report("a", 2000.0)
    assert rates.of("a") == pytest.approx(1200.0) and rates.of("b") == 100.0
