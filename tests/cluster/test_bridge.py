"""The bridge between local stores and a shared tier, against an in-memory tier: two nodes, one
publishing, one reading through; damage, outages and purges."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.clock import ManualClock
from prefixd.cluster import bridge as bridge_module
from prefixd.cluster.benefit import PROBE_S, FetchBenefit
from prefixd.cluster.blocks import block_key, decode_block, encode_block
from prefixd.cluster.bridge import SharedTierBridge
from prefixd.daemon.metrics import Metrics
from prefixd.daemon.services import Services
from prefixd.errors import RemoteBlockError, TierError, TierTransferError, TierUnavailableError
from prefixd.schema.chain import BlockChain
from prefixd.schema.content import chain_words
from prefixd.schema.tokens import Prompt
from prefixd.store.purge import PurgeSelector
from tests.waiting import wait_for

from .memory_tier import MemoryTier, Nodes, nodes, two_nodes  # noqa: F401 (a fixture)

IDENT = Identity(
    model="m",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=16,
    tenant="acme",
)
TOKENS = np.arange(16 * 6, dtype=np.uint32) + 900_000
PAYLOADS = [bytes([i]) * 50_000 for i in range(6)]


def publish(store: Store, bridge: SharedTierBridge, tier: MemoryTier) -> None:
    result = store.put(IDENT, TOKENS, PAYLOADS)
    bridge.published(IDENT, result.hashes)
    wait_for(lambda: len(tier.objects) >= len(PAYLOADS), "every block published", poll_s=0.01)


def loaded(store: Store) -> list[bytes]:
    out = bytearray(1 << 20)
    result = store.load(IDENT, TOKENS, out)
    return [bytes(out[o : o + n]) for o, n in zip(result.offsets, result.sizes, strict=True)]


def test_a_cold_miss_is_served_from_another_nodes_publication(nodes) -> None:
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 6
    assert loaded(b) == PAYLOADS  # installed locally, verified again on the way out
    assert b.check() == []
    counts = bridge_b.snapshot()
    assert counts["remote_hit_blocks"] == 6 and counts["remote_bytes"] == 6 * 50_000
    # a partial local prefix fetches only what follows it
    b.delete([BlockChain(IDENT, TOKENS).hash(4)])
    assert bridge_b.read_through(IDENT, TOKENS, 4) == 2


def test_a_damaged_remote_value_is_never_installed(nodes) -> None:
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    key = block_key(IDENT, BlockChain(IDENT, TOKENS).hash(3))
    damaged = bytearray(tier.objects[key])
    damaged[-100] ^= 0x01
    tier.objects[key] = bytes(damaged)
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 3  # stops before the damaged block
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 3
    assert bridge_b.snapshot()["remote_verify_failures"] == 1
    # a value that is another block's (a key pointing at the wrong object) is refused too
    tier.objects[key] = tier.objects[block_key(IDENT, BlockChain(IDENT, TOKENS).hash(4))]
    assert bridge_b.read_through(IDENT, TOKENS, 3) == 0


def test_a_value_larger_than_any_block_is_refused_before_memory_is_taken(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A size no block has (a hostile or broken value: 64 TiB) is a counted miss, never a buffer
    of that size; the node's own blocks are served as before."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    b.put(IDENT, TOKENS[:16], [PAYLOADS[0]])
    sizes = tier.size
    monkeypatch.setattr(tier, "size", lambda key: 1 << 46 if sizes(key) else None)
    taken: list[int] = []
    monkeypatch.setattr(tier, "buffer", lambda size: taken.append(size) or memoryview(b""))
    assert bridge_b.read_through(IDENT, TOKENS, 1) == 0
    assert taken == [] and bridge_b.snapshot()["fetch_errors"] == 1
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 1


def test_a_read_through_that_fails_unexpectedly_is_a_counted_miss(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails while reading through (the tier's client out of memory, say), the lookup
    gets what the local store holds, and the failure is counted and logged."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)

    def out_of_memory(*args: object) -> list[int | None]:
        raise MemoryError

    monkeypatch.setattr(tier, "get_many_into", out_of_memory)
    b.put(IDENT, TOKENS[:16], [PAYLOADS[0]])
    assert bridge_b.read_through(IDENT, TOKENS, 1) == 0
    assert bridge_b.snapshot()["read_through_errors"] == 1
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 1


def test_the_tier_down_costs_nothing_but_a_count(nodes) -> None:
    tier, (a, _b), (bridge_a, bridge_b) = nodes
    tier.down = True
    result = a.put(IDENT, TOKENS, PAYLOADS)
    bridge_a.published(IDENT, result.hashes)
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 0
    assert loaded(a) == PAYLOADS  # the local store answers alone
    assert bridge_b.snapshot()["fetch_errors"] >= 1
    wait_for(lambda: bridge_a.snapshot().get("publish_errors", 0) > 0, "a publish error")


def test_a_purge_removes_the_remote_copies(nodes) -> None:
    """A model's retirement removes the objects of the identities the node removed."""
    tier, (a, _), (bridge_a, _) = nodes
    publish(a, bridge_a, tier)
    other = Identity(**{**IDENT.to_dict(), "tenant": "globex"})
    tier.objects[block_key(other, b"\x01" * 16)] = b"x"
    report = bridge_a.purge(lambda: a.purge(PurgeSelector(model="m")))
    assert report.removed == (IDENT,)
    assert bridge_a.snapshot()["remote_purged_objects"] == 6
    assert list(tier.objects) == [block_key(other, b"\x01" * 16)]


def purge_everywhere(store: Store, bridge: SharedTierBridge, selector: PurgeSelector) -> None:
    """What the daemon's purge does on a node of the shared tier."""
    services = Services(
        store=store,
        pool=ThreadPoolExecutor(1),
        metrics=Metrics(store, prefill_tokens_per_s=1e4),
        max_frame_bytes=1 << 20,
        max_region_bytes=1 << 20,
        bridge=bridge,
    )
    services.purge_everywhere(selector)


def test_a_tenant_purged_on_one_node_leaves_the_tier_of_every_nodes_identities(nodes) -> None:
    """Node B purges tenant acme: the tier drops acme's objects of identities B never held
    (another node's model, say), and B reads none of acme's back; other tenants keep theirs."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    other = Identity(**{**IDENT.to_dict(), "kv_layout": "fp8"})  # acme's too, only on A
    globex = Identity(**{**IDENT.to_dict(), "tenant": "globex"})
    for identity in (other, globex):
        bridge_a.published(identity, a.put(identity, TOKENS, PAYLOADS).hashes)
    wait_for(lambda: len(tier.objects) == 18, "A's blocks published", poll_s=0.01)
    b.put(IDENT, TOKENS, PAYLOADS)
    purge_everywhere(b, bridge_b, PurgeSelector(tenant="acme"))
    assert len(tier.objects) == 6  # globex's
    assert bridge_b.read_through(other, TOKENS, 0) == 0
    assert bridge_b.read_through(globex, TOKENS, 0) == 6


def test_a_purge_the_tier_failed_keeps_its_objects_out_until_they_are_removed(nodes) -> None:
    """The tier is away when B purges acme: B reads none of acme's objects back meanwhile, and
    the removal is made again before its next read-through of acme, once the tier answers."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    globex = Identity(**{**IDENT.to_dict(), "tenant": "globex"})
    bridge_a.published(globex, a.put(globex, TOKENS, PAYLOADS).hashes)
    wait_for(lambda: len(tier.objects) == 12, "A's blocks published", poll_s=0.01)
    b.put(IDENT, TOKENS, PAYLOADS)
    tier.down = True
    purge_everywhere(b, bridge_b, PurgeSelector(tenant="acme"))
    assert bridge_b.snapshot()["purge_errors"] == 1
    tier.down = False
    remove_prefix = tier.remove_prefix
    tier.remove_prefix = lambda prefix, **kw: (_ for _ in ()).throw(TierUnavailableError("away"))
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # its removal failed again: a miss
    assert bridge_b.snapshot()["remote_skipped_unpurged"] == 1
    assert bridge_b.read_through(globex, TOKENS, 0) == 6  # another tenant is not held back
    tier.remove_prefix = remove_prefix
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # removed first, so nothing to read
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0
    assert len(tier.objects) == 6 and bridge_b.snapshot()["remote_purged_objects"] == 6


def test_a_read_through_under_way_when_a_purge_failed_in_the_tier_installs_nothing(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """B's read-through of acme has passed the check for unremoved purges and is asking the
    tier a value's size when B purges acme and the tier fails the removal: it installs nothing."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    asking, purged = threading.Event(), threading.Event()
    size = tier.size

    def size_once_purged(key: str) -> int | None:
        asking.set()
        assert purged.wait(10), "the purge did not come"
        return size(key)

    def away(prefix: str, **options: Any) -> int:
        raise TierUnavailableError("away")

    monkeypatch.setattr(tier, "size", size_once_purged)
    monkeypatch.setattr(tier, "remove_prefix", away)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(bridge_b.read_through, IDENT, TOKENS, 0)
        assert asking.wait(10)
        b.put(IDENT, TOKENS[:16], [PAYLOADS[0]])  # a block of acme for the purge to find
        purge_everywhere(b, bridge_b, PurgeSelector(tenant="acme"))
        assert bridge_b.snapshot()["purge_errors"] == 1
        purged.set()
        assert reading.result(10) == 0
    bridge_b.settle()
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0


def test_blocks_fetched_before_a_purge_are_not_installed_after_it(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-through whose fetch came back before B's purge of acme installs nothing after it,
    and its staged blocks are no longer served."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    proven, purged = threading.Event(), threading.Event()
    prove = bridge_b._proven

    def prove_then_wait(*args: Any) -> Any:
        found = prove(*args)
        proven.set()
        assert purged.wait(10), "the purge did not come"
        return found

    monkeypatch.setattr(bridge_b, "_proven", prove_then_wait)
    with ThreadPoolExecutor(1) as pool:
        reading = pool.submit(bridge_b.read_through, IDENT, TOKENS, 0)
        assert proven.wait(10)
        b.put(IDENT, TOKENS[:16], [PAYLOADS[0]])  # a block of acme for the purge to find
        purge_everywhere(b, bridge_b, PurgeSelector(tenant="acme"))
        purged.set()
        assert reading.result(10) == 0
    bridge_b.settle()
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0
    assert not tier.objects


def test_blocks_fetched_while_a_purge_runs_are_not_installed_after_it(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-through that starts once B's purge has begun fetches acme's objects (the tier still
    holds them), and installs nothing once the purge ends."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    b.put(IDENT, TOKENS[:16], [PAYLOADS[0]])  # a block of acme for the purge to find
    fetch, purge = tier.get_many_into, b.purge
    fetched = threading.Event()

    def fetch_and_tell(*args: Any) -> Any:
        got = fetch(*args)
        fetched.set()
        return got

    with ThreadPoolExecutor(1) as pool:
        reading: list[Any] = []

        def purge_once_fetched(*args: Any, **options: Any) -> Any:
            reading.append(pool.submit(bridge_b.read_through, IDENT, TOKENS, 0))
            assert fetched.wait(10), "the read-through did not fetch"
            return purge(*args, **options)

        monkeypatch.setattr(tier, "get_many_into", fetch_and_tell)
        monkeypatch.setattr(b, "purge", purge_once_fetched)
        purge_everywhere(b, bridge_b, PurgeSelector(tenant="acme"))
        assert reading[0].result(10) == 0
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0 and not tier.objects


def test_the_benefit_model_skips_fetches_slower_than_prefill(nodes) -> None:
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    b.put(IDENT, TOKENS[:16], [PAYLOADS[0]])  # the store knows its bytes per block
    bridge_b.benefit.prefill_tokens_per_s = 1e12  # prefill is (absurdly) faster than any fetch
    assert bridge_b.read_through(IDENT, TOKENS, 1) == 0
    assert bridge_b.snapshot()["remote_skipped_by_benefit"] == 1


def test_a_stale_benefit_model_is_probed_and_forgotten(nodes) -> None:
    """A tier that was slow for a while (a master restarting) leaves the model advising against
    every fetch, and it learns only from fetches: one is made anyway every PROBE_S, and when it
    beats the prefill, the model starts over."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    b.put(IDENT, TOKENS[:16], [PAYLOADS[0]])  # the store knows its bytes per block
    clock = [0.0]
    bridge_b.benefit = FetchBenefit(1000.0, now=lambda: clock[0])
    for n in range(1, 9):  # fetches that took a second per 50 KB
        bridge_b.benefit.fetch_time.observe(50_000 * n, float(n))
    assert bridge_b.read_through(IDENT, TOKENS, 1) == 0
    clock[0] += PROBE_S - 0.1
    assert bridge_b.read_through(IDENT, TOKENS, 1) == 0
    assert bridge_b.snapshot()["remote_skipped_by_benefit"] == 2
    clock[0] += 0.1
    assert bridge_b.read_through(IDENT, TOKENS, 1) == 5  # the probe, at memory speed
    assert bridge_b.snapshot()["remote_benefit_probes"] == 1
    # the model forgot the slow fetches: the next prompt is fetched without waiting for a probe
    other = TOKENS + 50_000
    result = a.put(IDENT, other, PAYLOADS)
    bridge_a.published(IDENT, result.hashes)
    wait_for(lambda: len(tier.objects) >= 12, "the second prompt published", poll_s=0.01)
    assert bridge_b.read_through(IDENT, other, 0) == 6
    assert bridge_b.snapshot()["remote_benefit_probes"] == 1


def test_a_read_through_fetches_a_batch_a_round_trip(nodes) -> None:
    """Six blocks: one size, one batch get; a value longer than the room the first one's size
    gives is fetched alone; every block is installed."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    longer = [*PAYLOADS[:2], PAYLOADS[2] * 3, *PAYLOADS[3:]]
    result = a.put(IDENT, TOKENS, longer)
    bridge_a.published(IDENT, result.hashes)
    wait_for(lambda: len(tier.objects) >= 6, "every block published", poll_s=0.01)
    tier.calls.clear()
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 6
    assert tier.calls == Counter(size=2, get_many_into=1, get_into=1)  # block 2 alone
    assert loaded(b) == longer


def test_values_fetched_alone_hold_one_batch_to_its_bytes(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short first value and longer ones after it: the batch its size gives ends before the
    values fetched alone would pass the batch's bytes; a later read-through goes on from there."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    monkeypatch.setattr(bridge_module, "_BATCH_BYTES", 120_000)
    uneven = [b"\x00" * 1_000, *PAYLOADS[1:]]  # the room 1,000 bytes give: 60 blocks a batch
    bridge_a.published(IDENT, a.put(IDENT, TOKENS, uneven).hashes)
    wait_for(lambda: len(tier.objects) >= 6, "every block published", poll_s=0.01)
    alone: list[int] = []
    get_into = tier.get_into

    def get_alone(key: str, buffer: bytearray) -> int | None:
        alone.append(len(buffer))
        return get_into(key, buffer)

    monkeypatch.setattr(tier, "get_into", get_alone)
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 3
    assert len(alone) == 2 and sum(alone) <= 120_000
    alone.clear()
    assert bridge_b.read_through(IDENT, TOKENS, 3) == 3  # sized by block 3: none alone
    assert not alone and loaded(b) == uneven


def test_a_read_through_counts_the_time_of_each_stage(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Microseconds fetching, proving, installing and in the read-through in all, on a clock
    that ticks a millisecond a reading: what tells an operator where a remote hit's time goes."""
    tier, (a, _b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    ticks = iter(range(1_000_000))
    clock = SimpleNamespace(perf_counter=lambda: next(ticks) / 1000, monotonic=time.monotonic)
    monkeypatch.setattr(bridge_module, "time", clock)
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 6
    counts = bridge_b.snapshot()
    stages = {s: counts[f"remote_{s}_us"] for s in ("fetch", "prove", "install", "read")}
    assert all(us >= 1000 and us % 1000 == 0 for us in stages.values()), stages
    assert stages["read"] > max(stages["fetch"], stages["prove"], stages["install"])


def test_batches_overlap_and_stop_at_the_first_failure(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of two blocks: a damaged value in the second batch stops the installs right
    before it, and a tier that fails mid-way leaves what came before it installed."""
    from prefixd.cluster import bridge as bridge_module

    monkeypatch.setattr(bridge_module, "_BATCH_BYTES", 2 * 60_000)
    monkeypatch.setattr(bridge_module, "_REFETCH_S", 0.0)  # the value mended below: asked at once
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    chain = BlockChain(IDENT, TOKENS)
    key = block_key(IDENT, chain.hash(3))
    good = tier.objects[key]
    tier.objects[key] = good[:-1] + bytes([good[-1] ^ 1])
    tier.calls.clear()
    third_fetched = threading.Event()
    fetch, prove = tier.get_many_into, bridge_b._proven

    def fetch_and_tell(*args):
        got = fetch(*args)
        if tier.calls["get_many_into"] == 3:
            third_fetched.set()
        return got

    def prove_once_the_third_is_fetched(identity, chain, start, values):
        if start == 2:  # the second batch: the third is on its way meanwhile
            assert third_fetched.wait(10), "the third batch was not fetched during the proof"
        return prove(identity, chain, start, values)

    monkeypatch.setattr(tier, "get_many_into", fetch_and_tell)
    monkeypatch.setattr(bridge_b, "_proven", prove_once_the_third_is_fetched)
    assert bridge_b.read_through(IDENT, TOKENS, 0) == 3
    assert tier.calls["get_many_into"] == 3  # the third, fetched while the second was proven
    assert bridge_b.snapshot()["remote_verify_failures"] == 1
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 3
    tier.objects[key] = good
    tier.fail_after = 2  # the size and the first batch; the second batch fails
    assert bridge_b.read_through(IDENT, TOKENS, 3) == 2
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 5
    assert bridge_b.snapshot()["fetch_errors"] == 1
    assert loaded(b)[:5] == PAYLOADS[:5]


def test_a_block_the_tier_missed_is_offered_again(nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tier that cannot be reached for a while (a master restarting): the blocks published
    meanwhile go back in the queue and reach the tier once it answers (three tries in all)."""
    from prefixd.cluster import bridge as bridge_module

    monkeypatch.setattr(bridge_module, "_BACKOFF_S", 0.2)  # a try every 0.2 s
    tier, (a, _), (bridge_a, _) = nodes
    tier.down = True
    result = a.put(IDENT, TOKENS, PAYLOADS[:2])
    bridge_a.published(IDENT, result.hashes)
    errors = bridge_a.snapshot
    wait_for(lambda: errors().get("publish_errors", 0) >= 2, "two failed tries", poll_s=0.01)
    tier.down = False
    wait_for(lambda: len(tier.objects) == 2, "both blocks published once the tier is back")
    assert bridge_a.snapshot()["published_blocks"] == 2
    tier.down = True  # down for good: each block is tried three times, then given up
    more = a.put(IDENT, TOKENS, PAYLOADS[:3])
    bridge_a.published(IDENT, more.hashes[2:])
    wait_for(lambda: bridge_a.snapshot()["publish_errors"] >= 2 + 3, "three more tries")
    wait_for(lambda: bridge_a.snapshot()["publish_queued"] == 0, "the block given up")
    assert bridge_a.snapshot()["publish_errors"] <= 4 + 3


def test_a_block_the_pool_had_no_room_for_is_offered_again(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For about a second after a master restart no client has remounted its segment, and
    Mooncake refuses puts as it does in a full pool (NO_AVAILABLE_HANDLE): a block published then
    goes back in the queue like one the tier could not be reached for."""
    from prefixd.cluster import bridge as bridge_module

    monkeypatch.setattr(bridge_module, "_BACKOFF_S", 0.2)
    tier, (a, _), (bridge_a, _) = nodes
    tier.full = True
    result = a.put(IDENT, TOKENS, PAYLOADS[:1])
    bridge_a.published(IDENT, result.hashes)
    wait_for(lambda: bridge_a.snapshot().get("publish_errors", 0) >= 1, "a refused put")
    tier.full = False
    wait_for(lambda: len(tier.objects) == 1, "the block published once the pool has room")
    assert bridge_a.snapshot()["published_blocks"] == 1


def test_a_tier_away_is_logged_now_and_then_and_every_failure_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A master away fails the read-through of every lookup that misses locally: hundreds a
    second on a busy node, and journald drops the lines of a service that floods it (the next
    real problem's among them). The first failure is logged, then one line every 10 s at most
    says how many were not; the counts hold every one."""
    clock = [1000.0]
    tier = MemoryTier()
    tier.down = True
    store = Store.open(tmp_path / "s", map_size=64 << 20)
    bridge = SharedTierBridge(
        store, tier, pending=8, prefill_tokens_per_s=1000.0, now=lambda: clock[0]
    )
    bridge.start()
    try:
        with caplog.at_level(logging.WARNING, logger="prefixd.cluster.bridge"):
            for _ in range(50):
                assert bridge.read_through(IDENT, TOKENS, 0) == 0
            clock[0] += 9.9
            assert bridge.read_through(IDENT, TOKENS, 0) == 0
            clock[0] += 0.1
            assert bridge.read_through(IDENT, TOKENS, 0) == 0
        lines = [r.getMessage() for r in caplog.records if "fetching" in r.getMessage()]
        assert len(lines) == 2, lines
        assert lines[0] == "fetching from the shared tier failed: shared tier unavailable"
        assert lines[1].endswith("(50 more since the last such line)")
        assert bridge.snapshot()["fetch_errors"] == 52
    finally:
        bridge.stop(timeout_s=0.5)
        store.close()


@contextlib.contextmanager
def clocked_nodes(tmp_path: Path, now: Callable[[], float]) -> Iterator[Nodes]:
    """Two bridged stores over one in-memory tier, node B's bridge on the clock `now`."""
    tier = MemoryTier()
    a = Store.open(tmp_path / "a", map_size=64 << 20)
    b = Store.open(tmp_path / "b", map_size=64 << 20)
    bridge_a = SharedTierBridge(a, tier, pending=64, prefill_tokens_per_s=1000.0)
    bridge_b = SharedTierBridge(b, tier, pending=8, prefill_tokens_per_s=1000.0, now=now)
    for bridge in (bridge_a, bridge_b):
        bridge.start()
    try:
        yield tier, [a, b], [bridge_a, bridge_b]
    finally:
        for bridge in (bridge_a, bridge_b):
            bridge.stop(timeout_s=0.5)
        a.close()
        b.close()


def test_a_fetch_that_failed_is_not_made_again_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value in a dead peer's segment: Mooncake fails its transfer after about a second, and
    again at every try until the master drops the segment 10 s later, so each lookup of the
    prompt would wait that second. The prompt is not fetched again for 10 s. Other failures are
    not remembered so: a value still being put (REPLICA_IS_NOT_READY) is there a moment later,
    and an unreachable tier's cooldown already answers at once."""
    clock = [1000.0]
    with clocked_nodes(tmp_path, lambda: clock[0]) as (tier, (a, b), (bridge_a, bridge_b)):
        publish(a, bridge_a, tier)
        wait_for(lambda: len(tier.objects) == 6, "A's blocks published", poll_s=0.01)
        fetch = tier.get_many_into
        failure: list[TierError] = [TierError("get failed: REPLICA_IS_NOT_READY (-703)", -703)]

        def failing(*args: object) -> list[int | None]:
            tier.calls["get_many_into"] += 1
            raise failure[0]

        monkeypatch.setattr(tier, "get_many_into", failing)
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # a value still being put:
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # asked again at once
        assert tier.calls["get_many_into"] == 2
        failure[0] = TierTransferError("get failed: TRANSFER_FAIL (-800)", -800)
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0
        assert tier.calls["get_many_into"] == 3
        clock[0] += 9.9
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # not asked: it would fail again
        assert tier.calls["get_many_into"] == 3
        assert bridge_b.snapshot()["remote_skipped_after_failure"] == 1
        clock[0] += 0.1
        failure[0] = TierUnavailableError("no answer within 1.0 s")
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # asked again, and unreachable
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # not remembered: asked again
        assert tier.calls["get_many_into"] == 5
        monkeypatch.setattr(tier, "get_many_into", fetch)
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 6
        assert loaded(b) == PAYLOADS


def test_a_value_that_failed_its_proof_is_not_fetched_again_for_a_while(tmp_path: Path) -> None:
    """A value put first keeps its key (the tier keeps the first value): a damaged or planted one
    would be fetched and refused at every lookup of its prompt. It is asked again after 10 s."""
    clock = [1000.0]
    with clocked_nodes(tmp_path, lambda: clock[0]) as (tier, (a, b), (bridge_a, bridge_b)):
        first = block_key(IDENT, BlockChain(IDENT, TOKENS).hash(0))
        tier.objects[first] = bytes(64 << 10)  # planted before A publishes
        publish(a, bridge_a, tier)
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # not fetched: it would fail again
        assert tier.calls["get_many_into"] == 1
        counts = bridge_b.snapshot()
        assert counts["remote_verify_failures"] == 1
        assert counts["remote_skipped_after_failure"] == 1
        clock[0] += 10.0
        assert bridge_b.read_through(IDENT, TOKENS, 0) == 0  # asked again, refused again
        assert tier.calls["get_many_into"] == 2
        assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0  # nothing of it installed


def test_engine_keyed_blocks_are_shared_the_same_way(nodes) -> None:
    """Blocks named by an engine's keys (vLLM's 36-byte ones) travel, are proven and installed
    like token-keyed ones: the key takes the tokens' place in the chain and in the proof."""
    from prefixd.schema.keys import pack_keys

    tier, (a, b), (bridge_a, bridge_b) = nodes
    keyed = Identity(**{**IDENT.to_dict(), "key_bytes": 36})
    keys = pack_keys(keyed, [bytes([i]) * 36 for i in range(4)])
    result = a.put(keyed, keys, PAYLOADS[:4])
    bridge_a.published(keyed, result.hashes)
    wait_for(lambda: len(tier.objects) >= 4, "every block published", poll_s=0.01)
    assert bridge_b.read_through(keyed, keys, 0) == 4
    out = bytearray(1 << 20)
    got = b.load(keyed, keys, out)
    assert [bytes(out[o : o + n]) for o, n in zip(got.offsets, got.sizes, strict=True)] == (
        PAYLOADS[:4]
    )
    # another key at block 2 names another chain: there is nothing to fetch
    other = pack_keys(keyed, [bytes([i if i != 2 else 99]) * 36 for i in range(4)])
    assert bridge_b.read_through(keyed, other, 2) == 0


def test_blocks_covering_a_requests_content_are_shared_the_same_way(nodes) -> None:
    """An identity with request_content: node B installs from the tier what A put, under the
    wire form (token ids and content digests) the daemon receives."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    content = replace(IDENT, request_content=True)
    wire = chain_words(content, Prompt(TOKENS, salt="user-7")).tobytes()
    bridge_a.published(content, a.put(content, wire, PAYLOADS).hashes)
    wait_for(lambda: len(tier.objects) >= 6, "every block published", poll_s=0.01)
    assert bridge_b.read_through(content, wire, 0) == 6
    assert b.longest_prefix(content, wire).n_blocks == 6
    assert "install_errors" not in bridge_b.snapshot()


def test_a_share_groups_blocks_are_shared_under_the_group(tmp_path: Path) -> None:
    """acme and beta share group g on both nodes: what A stored for acme is found by B for beta,
    under the group's keys, and a purge of the group removes it from the tier."""
    beta = replace(IDENT, tenant="beta")
    with two_nodes(tmp_path, share_groups={"g": ("acme", "beta")}) as (tier, [a, b], bridges):
        bridge_a, bridge_b = bridges
        publish(a, bridge_a, tier)
        group = replace(IDENT, tenant="share:g")
        assert set(tier.objects) == {block_key(group, h) for h in BlockChain(group, TOKENS)}
        assert bridge_b.read_through(beta, TOKENS, 0, staged=True) == 6
        bridge_b.settle()
        assert b.longest_prefix(beta, TOKENS).n_blocks == 6
        purge_everywhere(b, bridge_b, PurgeSelector(tenant="share:g"))
        assert not tier.objects and b.longest_prefix(beta, TOKENS).n_blocks == 0


def test_a_value_past_its_tenants_time_to_live_is_not_installed(tmp_path: Path) -> None:
    """acme's entries live an hour on both nodes: a value A published two hours ago is not
    installed on B (nor served) as if it were fresh; one A published since is."""
    clock, fresh = ManualClock(), replace(IDENT, kv_layout="fp8")
    with two_nodes(tmp_path, tenant_ttls={"acme": 3600.0}, clock=clock) as (tier, [a, b], bridges):
        bridge_a, bridge_b = bridges
        publish(a, bridge_a, tier)
        clock.advance(2 * 3600)
        bridge_a.published(fresh, a.put(fresh, TOKENS, PAYLOADS).hashes)
        wait_for(lambda: len(tier.objects) == 12, "every block published", poll_s=0.01)
        assert bridge_b.read_through(IDENT, TOKENS, 0, staged=True) == 0
        assert bridge_b.with_staged(IDENT, TOKENS, b.longest_prefix(IDENT, TOKENS)).n_blocks == 0
        assert bridge_b.snapshot()["remote_expired_blocks"] == 1
        assert bridge_b.read_through(fresh, TOKENS, 0) == 6


def test_an_installed_blocks_time_to_live_counts_from_its_origin(tmp_path: Path) -> None:
    """acme's entries live an hour: a block B installs 40 minutes after A stored it expires on
    B when it does on A, not an hour after its install."""
    clock = ManualClock()
    with two_nodes(tmp_path, tenant_ttls={"acme": 3600.0}, clock=clock) as (tier, [a, b], bridges):
        publish(a, bridges[0], tier)
        clock.advance(40 * 60)
        assert bridges[1].read_through(IDENT, TOKENS, 0) == 6
        assert b.longest_prefix(IDENT, TOKENS).n_blocks == 6
        clock.advance(21 * 60)  # an hour and a minute after A stored them
        assert a.longest_prefix(IDENT, TOKENS).n_blocks == 0
        assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0


def test_remote_values_are_proven_before_use() -> None:
    chain = BlockChain(IDENT, TOKENS)
    from prefixd.schema.records import BlockRecord, Compression

    record = BlockRecord(
        Compression.NONE,
        0,
        0,
        0,
        3,
        3,
        1,
        IDENT.digest,
        chain.parent_of(0),
        bytes(chain.block_bytes(0)),
    ).encode()
    value = encode_block(record, b"abc")
    proven = {
        "identity_digest": IDENT.digest,
        "parent": chain.parent_of(0),
        "tokens": bytes(chain.block_bytes(0)),
    }
    assert bytes(decode_block(value, **proven).payload) == b"abc"
    for bad in (value[:10], b"XXXX" + value[4:], value[:-1] + b"d", value + b"!"):
        with pytest.raises(RemoteBlockError):
            decode_block(bad, **proven)
    with pytest.raises(RemoteBlockError, match="another block"):
        decode_block(value, **{**proven, "tokens": bytes(chain.block_bytes(1))})
