"""Which tenant owns what, after any history: puts of new identities, tenant purges, model
retirements, TTL expiries and restarts keep the per-tenant totals, the quotas and the Prometheus
series equal to a reference model (the tenant of an identity is read from the identities table in
the transaction that uses it, never from a cache that a purge can leave stale)."""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from prefixd import Identity, Store
from prefixd.clock import ManualClock
from prefixd.daemon.metrics import Metrics
from prefixd.store.purge import PurgeSelector

BASE = Identity(
    model="m",
    weights="v1",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=4,
    tenant="a",
)
TENANTS = ("a", "b", "c")
VERSIONS = ("v1", "v2", "v3")
QUOTA = 2_000  # tenant "a" only: what its puts may keep (times the high watermark)
TTL_S = 60  # tenant "c" only
BLOCK_BYTES = (100, 250)  # by prompt seed parity


def ident(tenant: str, version: str) -> Identity:
    return dataclasses.replace(BASE, tenant=tenant, weights=version)


def prompt(seed: int, n_blocks: int) -> np.ndarray:
    return (np.arange(n_blocks * BASE.block_tokens, dtype=np.uint32) * 7 + seed * 1000) % 50_000


def open_store(path: Path, clock: ManualClock) -> Store:
    return Store.open(
        path,
        map_size=64 << 20,
        clock=clock,
        tenant_quotas=(f"a={QUOTA}",),
        tenant_ttls=(f"c={TTL_S}s",),
    )


def served(registry: Any, name: str) -> dict[str, float]:
    """A per-tenant Prometheus gauge, as a scrape would see it."""
    return {
        sample.labels["tenant"]: sample.value
        for family in registry.collect()
        if family.name == name
        for sample in family.samples
    }


def test_an_identity_written_after_a_purge_has_its_tenant(tmp_path: Path) -> None:
    """The reported bug: after a purge removed one identity, a new one's blocks were counted
    for a tenant named "" and were never held to their tenant's quota."""
    clock = ManualClock()
    with open_store(tmp_path / "s", clock) as store:
        store.put(ident("b", "v1"), prompt(0, 2), [bytes(100)] * 2)
        store.put(ident("c", "v1"), prompt(0, 2), [bytes(100)] * 2)
        assert set(store.tenant_totals()) == {"b", "c"}
        store.purge(PurgeSelector(tenant="b"))
        store.put(ident("b", "v2"), prompt(1, 3), [bytes(100)] * 3)
        assert store.tenant_totals() == {
            "b": {"blocks": 3, "stored_bytes": 300},
            "c": {"blocks": 2, "stored_bytes": 200},
        }
        store.purge(PurgeSelector(tenant="c"))
        for seed in range(10):  # far past its quota, were its identity's bytes not counted
            store.put(ident("a", "v1"), prompt(seed, 4), [bytes(250)] * 4)
            assert store.tenant_bytes("a") <= QUOTA
        assert store.tenant_totals()["a"]["stored_bytes"] == store.tenant_bytes("a")
        assert "" not in store.tenant_totals()


class TenancyMachine(RuleBasedStateMachine):
    """Tenants b and c exactly as a model predicts; tenant a (under a quota, so eviction picks
    which blocks go) within its quota and consistent with the store's own inventory."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="tenancy-"))
        self.clock = ManualClock()
        self.store = open_store(self.dir / "s", self.clock)
        self.metrics = Metrics(self.store, prefill_tokens_per_s=1e4)
        # (tenant, version, seed, block index) -> payload bytes, for tenants b and c
        self.blocks: dict[tuple[str, str, int, int], int] = {}

    @rule(
        tenant=st.sampled_from(TENANTS),
        version=st.sampled_from(VERSIONS),
        seed=st.integers(0, 3),
        n_blocks=st.integers(1, 4),
    )
    def put(self, tenant: str, version: str, seed: int, n_blocks: int) -> None:
        size = BLOCK_BYTES[seed % 2]
        self.store.put(ident(tenant, version), prompt(seed, n_blocks), [bytes(size)] * n_blocks)
        if tenant == "a":
            assert self.store.tenant_bytes("a") <= QUOTA, "tenant a kept more than its quota"
        else:
            for i in range(n_blocks):
                self.blocks[tenant, version, seed, i] = size

    @rule(tenant=st.sampled_from(TENANTS))
    def purge_tenant(self, tenant: str) -> None:
        self.store.purge(PurgeSelector(tenant=tenant))
        self.blocks = {k: v for k, v in self.blocks.items() if k[0] != tenant}

    @rule(keep=st.sampled_from(VERSIONS))
    def retire(self, keep: str) -> None:
        """A model upgrade: every version of the model but `keep` goes, for every tenant."""
        self.store.purge(PurgeSelector(model="m", keep={"weights": keep}))
        self.blocks = {k: v for k, v in self.blocks.items() if k[1] == keep}

    @rule()
    def expire(self) -> None:
        """Tenant c's time to live passes: its blocks go when they are reclaimed."""
        self.clock.advance(TTL_S + 1)
        self.store.reclaim_expired()
        self.blocks = {k: v for k, v in self.blocks.items() if k[0] != "c"}

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = open_store(self.dir / "s", self.clock)
        self.metrics = Metrics(self.store, prefill_tokens_per_s=1e4)

    def expected(self) -> dict[str, dict[str, int]]:
        totals: dict[str, dict[str, int]] = {}
        for (tenant, *_), size in self.blocks.items():
            entry = totals.setdefault(tenant, {"blocks": 0, "stored_bytes": 0})
            entry["blocks"] += 1
            entry["stored_bytes"] += size
        return totals

    @invariant()
    def totals_match_the_model(self) -> None:
        totals = self.store.tenant_totals()
        a = totals.pop("a", {"blocks": 0, "stored_bytes": 0})
        assert totals == self.expected()
        assert a["stored_bytes"] == self.store.tenant_bytes("a") <= QUOTA
        for tenant in ("b", "c"):
            assert self.store.tenant_bytes(tenant) == self.expected().get(tenant, {}).get(
                "stored_bytes", 0
            )
        stats = self.store.stats()
        assert stats.blocks == a["blocks"] + sum(t["blocks"] for t in totals.values())

    @invariant()
    def prometheus_series_match(self) -> None:
        totals = self.store.tenant_totals()
        registry = self.metrics.registry
        assert served(registry, "prefixd_stored_bytes") == {
            t: float(v["stored_bytes"]) for t, v in totals.items()
        }
        assert served(registry, "prefixd_stored_blocks") == {
            t: float(v["blocks"]) for t, v in totals.items()
        }

    @invariant()
    def inventory_is_consistent(self) -> None:
        assert self.store.check() == []

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TenancyMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_tenancy_matches_a_reference_model = TenancyMachine.TestCase
