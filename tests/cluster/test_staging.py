"""Proven remote blocks served from their fetch buffers while the local install runs behind them
(prefixd.cluster.staging), against an in-memory tier: held installs, failed installs, loads
through small buffers, deletes after a read-through, and the buffers given back."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from prefixd import Store
from prefixd.cluster import bridge as bridge_module
from prefixd.cluster.bridge import SharedTierBridge
from prefixd.errors import DiskFullError
from prefixd.schema.chain import BlockChain
from prefixd.store.purge import PurgeSelector
from tests.waiting import wait_for

from .memory_tier import MemoryTier, nodes  # noqa: F401 (a fixture)
from .test_bridge import IDENT, PAYLOADS, TOKENS, publish, purge_everywhere

WAIT_S = 60.0  # an upper bound on a step another thread finishes at once, not a timing


class HeldInstalls:
    """Holds node B's store puts (its installs) until `release`; `fail_from` makes the put of a
    batch starting at that block fail as a full disk would."""

    def __init__(self, store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
        self.store = store
        self.go = threading.Event()
        self.started: list[int] = []
        self.fail_from: int | None = None
        real = store.put

        def put(*args: Any, **kwargs: Any) -> Any:
            first = kwargs.get("first_block", 0)
            self.started.append(first)
            assert self.go.wait(WAIT_S)
            if self.fail_from is not None and first >= self.fail_from:
                raise DiskFullError("no room for the install")
            return real(*args, **kwargs)

        monkeypatch.setattr(store, "put", put)

    def release(self) -> None:
        self.go.set()


@pytest.fixture
def held(nodes, monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldInstalls]:
    _, (_, b), _ = nodes
    holder = HeldInstalls(b, monkeypatch)
    yield holder
    holder.release()  # a failed test must not leave the installer waiting


def two_blocks_a_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bridge_module, "_BATCH_BYTES", 2 * 60_000)


def payloads_of(out: bytearray, result: Any) -> list[bytes]:
    return [bytes(out[o : o + n]) for o, n in zip(result.offsets, result.sizes, strict=True)]


def test_staged_blocks_are_served_before_their_install(
    nodes,
    held: HeldInstalls,
) -> None:
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    # returns with the install still held: the blocks are proven and staged
    assert bridge_b.read_through(IDENT, TOKENS, 0, staged=True) == 6
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0  # not installed yet
    match = bridge_b.with_staged(IDENT, TOKENS, b.longest_prefix(IDENT, TOKENS))
    assert match.n_blocks == 6 and match.payload_sizes == (50_000,) * 6
    assert match.hashes == tuple(BlockChain(IDENT, TOKENS).hashes())
    out = bytearray(1 << 20)
    result = bridge_b.load(IDENT, TOKENS, out)
    assert (result.n_blocks, result.n_tokens, result.next_size) == (6, 96, 0)
    assert payloads_of(out, result) == PAYLOADS
    # through a buffer with room for two blocks, then from block 2 on, as an engine streams
    small = bytearray(120_000)
    first = bridge_b.load(IDENT, TOKENS, small)
    assert (first.n_blocks, first.next_size) == (2, 50_000)
    assert payloads_of(small, first) == PAYLOADS[:2]
    rest = bridge_b.load(IDENT, TOKENS, out, first_block=2, max_blocks=3)
    assert (rest.first_block, rest.n_blocks, rest.n_tokens) == (2, 3, 80)
    assert payloads_of(out, rest) == PAYLOADS[2:5]
    # a second read-through of the prompt fetches nothing: the staged blocks count as local
    tier.calls.clear()
    assert bridge_b.read_through(IDENT, TOKENS, 0, staged=True) == 0
    assert not tier.calls
    held.release()
    bridge_b.settle()
    assert not len(bridge_b.staging)
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 6  # installed, and served from the store
    assert payloads_of(out, bridge_b.load(IDENT, TOKENS, out)) == PAYLOADS
    counts = bridge_b.snapshot()
    assert counts["remote_staged_blocks"] == counts["remote_hit_blocks"] == 6
    assert counts["remote_installed_blocks"] == 6
    assert counts["remote_staged_served_blocks"] == 6 + 2 + 3  # the three loads above


def test_a_load_continues_from_the_store_where_installs_ended(
    nodes,
    held: HeldInstalls,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batches of two: the first installed and gone from the staging, the rest staged; one
    load answers all six, from the store and then from the staging."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    two_blocks_a_batch(monkeypatch)
    publish(a, bridge_a, tier)
    held.release()
    ended = threading.Event()
    real_end = bridge_b.staging.end
    gate = threading.Event()

    def end(run: Any) -> None:  # the second and third batches wait in the staging
        real_end(run)
        if len(held.started) == 1:
            ended.set()
            assert gate.wait(WAIT_S)

    monkeypatch.setattr(bridge_b.staging, "end", end)
    try:
        assert bridge_b.read_through(IDENT, TOKENS, 0, staged=True) == 6
        assert ended.wait(WAIT_S)
        assert b.longest_prefix(IDENT, TOKENS).n_blocks == 2
        out = bytearray(1 << 20)
        result = bridge_b.load(IDENT, TOKENS, out)
        assert result.n_blocks == 6 and payloads_of(out, result) == PAYLOADS
    finally:
        gate.set()
    bridge_b.settle()
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 6


def test_a_load_finds_in_the_store_what_left_the_staging_while_it_read(
    nodes,
    held: HeldInstalls,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every install ends between the load's read of the store (nothing there yet) and its look
    at the staging (nothing left there): the load asks the store again, and has all six."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    two_blocks_a_batch(monkeypatch)
    publish(a, bridge_a, tier)
    assert bridge_b.read_through(IDENT, TOKENS, 0, staged=True) == 6
    real_load = b.load
    calls: list[int] = []

    def load(*args: Any, **kwargs: Any) -> Any:
        result = real_load(*args, **kwargs)
        calls.append(result.n_blocks)
        if len(calls) == 1:
            held.release()
            bridge_b.settle()
        return result

    monkeypatch.setattr(b, "load", load)
    out = bytearray(1 << 20)
    result = bridge_b.load(IDENT, TOKENS, out)
    assert calls == [0, 6]
    assert result.n_blocks == 6 and payloads_of(out, result) == PAYLOADS


def test_a_failed_install_takes_its_staged_blocks_and_those_after_away(
    nodes,
    held: HeldInstalls,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tier, (a, b), (bridge_a, bridge_b) = nodes
    two_blocks_a_batch(monkeypatch)
    publish(a, bridge_a, tier)
    held.fail_from = 2
    assert bridge_b.read_through(IDENT, TOKENS, 0, staged=True) == 6
    assert bridge_b.with_staged(IDENT, TOKENS, b.longest_prefix(IDENT, TOKENS)).n_blocks == 6
    held.release()
    bridge_b.settle()
    # the second batch's install failed; the third was not tried
    assert held.started == [0, 2]
    assert not len(bridge_b.staging)
    match = bridge_b.with_staged(IDENT, TOKENS, b.longest_prefix(IDENT, TOKENS))
    assert match.n_blocks == 2
    out = bytearray(1 << 20)
    assert payloads_of(out, bridge_b.load(IDENT, TOKENS, out)) == PAYLOADS[:2]
    counts = bridge_b.snapshot()
    assert counts["install_errors"] == 1 and counts["remote_installed_blocks"] == 2


def test_a_delete_after_a_read_through_removes_what_it_installs(
    nodes,
    held: HeldInstalls,
) -> None:
    """`settle` (which the daemon's delete and purge call first) waits for the installs queued
    before it: the delete that follows finds the blocks and removes them; they do not come back
    after it."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    assert bridge_b.read_through(IDENT, TOKENS, 0, staged=True) == 6

    def settle_and_delete() -> int:
        bridge_b.settle()
        return b.delete([BlockChain(IDENT, TOKENS).hash(0)])

    with ThreadPoolExecutor(1) as pool:
        deleting = pool.submit(settle_and_delete)
        held.release()
        assert deleting.result(WAIT_S) == 6
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0
    assert bridge_b.with_staged(IDENT, TOKENS, b.longest_prefix(IDENT, TOKENS)).n_blocks == 0


def test_blocks_fetched_before_a_purge_are_not_staged_after_it(
    nodes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A staged read-through proven before B's purge of acme and staging after it: neither a
    lookup nor a load serves its blocks, though their install is still queued behind another."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    publish(a, bridge_a, tier)
    proven, purged, installer_free = threading.Event(), threading.Event(), threading.Event()
    prove = bridge_b._proven

    def prove_then_wait(*args: Any) -> Any:
        found = prove(*args)
        proven.set()
        assert purged.wait(WAIT_S), "the purge did not come"
        return found

    monkeypatch.setattr(bridge_b, "_proven", prove_then_wait)
    bridge_b._installer.submit(installer_free.wait, WAIT_S)  # an earlier install, still running
    try:
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(bridge_b.read_through, IDENT, TOKENS, 0, staged=True)
            assert proven.wait(WAIT_S)
            purge_everywhere(b, bridge_b, PurgeSelector(tenant="acme"))
            purged.set()
            assert reading.result(WAIT_S) == 0
        assert bridge_b.with_staged(IDENT, TOKENS, b.longest_prefix(IDENT, TOKENS)).n_blocks == 0
        assert bridge_b.load(IDENT, TOKENS, bytearray(1 << 20)).n_blocks == 0
    finally:
        installer_free.set()
    bridge_b.settle()
    assert b.longest_prefix(IDENT, TOKENS).n_blocks == 0 and not len(bridge_b.staging)


def test_settling_a_stopped_bridge_returns_at_once(nodes) -> None:
    """A delete that races the daemon's shutdown: `stop` waited for the installs already."""
    _, _, (_, bridge_b) = nodes
    bridge_b.stop(timeout_s=0.5)
    bridge_b.settle()


class CountingTier(MemoryTier):
    """Counts the buffers handed out and not given back."""

    def __init__(self) -> None:
        super().__init__()
        self.out: set[int] = set()
        self.most_out = 0

    def buffer(self, size: int) -> memoryview:
        view = super().buffer(size)
        self.out.add(id(view.obj))
        self.most_out = max(self.most_out, len(self.out))
        return view

    def release(self, view: memoryview) -> None:
        self.out.discard(id(view.obj))


CountingBridge = tuple[SharedTierBridge, CountingTier]


def counting_bridge(store: Store, tier: MemoryTier, staging_bytes: int) -> CountingBridge:
    counting = CountingTier()
    counting.objects = tier.objects
    bridge = SharedTierBridge(
        store, counting, pending=8, prefill_tokens_per_s=1000.0, staging_bytes=staging_bytes
    )
    bridge.start()
    return bridge, counting


def test_staged_buffers_are_bounded(
    nodes,
    held: HeldInstalls,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No room for staging past the three buffers: with the installs held, the read-through
    waits for them rather than take a fourth buffer."""
    tier, (a, b), (bridge_a, _) = nodes
    monkeypatch.setattr(bridge_module, "_BATCH_BYTES", 60_000)  # a block a batch
    publish(a, bridge_a, tier)
    bridge, counting = counting_bridge(b, tier, staging_bytes=0)
    try:
        with ThreadPoolExecutor(1) as pool:
            reading = pool.submit(bridge.read_through, IDENT, TOKENS, 0, staged=True)
            wait_for(lambda: len(held.started) == 1, "the first install", poll_s=0.01)
            held.release()
            assert reading.result(WAIT_S) == 6
        bridge.settle()
        assert counting.most_out == 3 and not counting.out
        assert b.longest_prefix(IDENT, TOKENS).n_blocks == 6
    finally:
        bridge.stop(timeout_s=0.5)


def test_a_staged_buffer_is_given_back_once_nobody_reads_it(
    nodes,
    held: HeldInstalls,
) -> None:
    tier, (a, b), (bridge_a, _) = nodes
    publish(a, bridge_a, tier)
    bridge, counting = counting_bridge(b, tier, staging_bytes=1 << 20)
    copying, finish_copy = threading.Event(), threading.Event()

    class SlowView:
        """A load's buffer whose first copy waits for `finish_copy`."""

        def __init__(self, view: memoryview) -> None:
            self.view = view
            self.nbytes = view.nbytes

        def __setitem__(self, key: slice, value: memoryview) -> None:
            copying.set()
            assert finish_copy.wait(WAIT_S)
            self.view[key] = value

        def __getitem__(self, key: slice) -> SlowView:
            return SlowView(self.view[key])

    out = bytearray(1 << 20)
    slow: Any = SlowView(memoryview(out))
    try:
        with ThreadPoolExecutor(1) as pool:
            assert bridge.read_through(IDENT, TOKENS, 0, staged=True) == 6
            assert len(counting.out) == 1
            chain = BlockChain(IDENT, TOKENS)
            load = pool.submit(bridge.staging.copy_into, chain, 0, 2, slow)
            assert copying.wait(WAIT_S)
            held.release()
            bridge.settle()
            assert len(counting.out) == 1  # installed, and still read from
            finish_copy.set()
            assert load.result(WAIT_S).sizes == [50_000, 50_000]
        assert bytes(out[:100_000]) == PAYLOADS[0] + PAYLOADS[1]
        assert not counting.out
    finally:
        finish_copy.set()
        held.release()
        bridge.stop(timeout_s=0.5)
