"""Per-tenant totals and removal counts: what the daemon's metrics report per tenant."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from prefixd import Identity, Store
from prefixd.store.purge import PurgeSelector


def test_tenant_totals_and_removals_by_reason(tmp_path: Path, identity: Identity) -> None:
    bt = identity.block_tokens
    other = dataclasses.replace(identity, tenant="b")
    old_model = dataclasses.replace(identity, weights="old")
    tokens = np.arange(6 * bt, dtype=np.uint32)
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        store.put(identity, tokens, [b"a" * 100] * 6)
        store.put(other, tokens, [b"b" * 50] * 4)
        store.put(old_model, tokens, [b"c" * 10] * 2)
        assert store.tenant_totals() == {
            "a": {"blocks": 8, "stored_bytes": 620},
            "b": {"blocks": 4, "stored_bytes": 200},
        }
        store.evict(store.stats().stored_bytes - 150)  # the cheapest leaves go first
        store.purge(PurgeSelector(model="m", keep={"weights": "w"}))
        store.purge(PurgeSelector(tenant="b"))
        store.delete([store.longest_prefix(identity, tokens).hashes[3]])
        removals = store.removals()
        evicted = sum(r.get("evicted", 0) for r in removals.values())
        assert evicted >= 1
        assert removals["a"].get("retired", 0) + removals["a"].get("evicted", 0) >= 2
        assert removals["b"]["purged"] + removals["b"].get("evicted", 0) == 4
        assert removals["a"]["deleted"] >= 1
        totals = store.tenant_totals()
        assert totals["a"]["blocks"] == store.stats().blocks and "b" not in totals
        assert store.check() == []
