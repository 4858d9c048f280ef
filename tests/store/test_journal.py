"""What the store tells its observer (prefixd.store.journal): a view rebuilt from the committed
changes alone equals the store's own inventory after any history of puts, refused puts,
evictions, tenant quotas, TTL expiries, purges, model retirements, deletes, quarantines of
damaged payloads, repairs and restarts; a transaction that aborts tells nothing."""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixd import Identity, Store
from prefixd.clock import ManualClock
from prefixd.errors import OrphanBlockError, PayloadError
from prefixd.schema.chain import chain_hashes
from prefixd.store.journal import BlockChange
from prefixd.store.purge import PurgeSelector

from ..waiting import DEADLINE_S, wait_for
from .test_faults import flip_in_file

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
ENGINE_KEYED = dataclasses.replace(BASE, tenant="e", key_bytes=16)
TENANTS = ("a", "b", "c")
VERSIONS = ("v1", "v2")
BLOCK_BYTES = 512
QUOTA = 6 * BLOCK_BYTES  # tenant "b"
TTL_S = 60  # tenant "c"


def ident(tenant: str, version: str) -> Identity:
    return dataclasses.replace(BASE, tenant=tenant, weights=version)


def prompt(seed: int, n_blocks: int) -> np.ndarray:
    return (np.arange(n_blocks * BASE.block_tokens, dtype=np.uint32) * 7 + seed * 1000) % 50_000


def payloads(rng: np.random.Generator, n: int) -> list[bytes]:
    """Random bytes, so that one of them can be found in the data file and damaged."""
    return [rng.bytes(BLOCK_BYTES) for _ in range(n)]


def open_store(path: Path, clock: ManualClock) -> Store:
    return Store.open(
        path,
        map_size=64 << 20,
        clock=clock,
        capacity_bytes=40 * BLOCK_BYTES,
        tenant_quotas=(f"b={QUOTA}",),
        tenant_ttls=(f"c={TTL_S}s",),
    )


class View:
    """A consumer's view of the store, built from the observer's changes alone."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, BlockChange] = {}
        self.reasons: set[str] = set()
        self.told: list[BlockChange] = []

    def committed(self, changes: Sequence[BlockChange]) -> None:
        self.told.extend(changes)
        for change in changes:
            self.reasons.add(change.reason)
            if change.stored:
                assert change.block not in self.blocks, "a block stored twice"
                self.blocks[change.block] = change
            else:
                assert change.block in self.blocks, f"{change.reason}: a block never stored"
                del self.blocks[change.block]


def inventory(store: Store) -> dict[bytes, BlockChange]:
    return {change.block: change for batch in store.inventory(batch=7) for change in batch}


class JournalMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="journal-"))
        self.clock = ManualClock()
        self.rng = np.random.default_rng(7)
        self.view = View()
        self.store = open_store(self.dir / "s", self.clock)
        self.store.observe(self.view)
        self.stored_payloads: dict[bytes, bytes] = {}  # block -> its payload, to damage one

    @rule(
        tenant=st.sampled_from(TENANTS),
        version=st.sampled_from(VERSIONS),
        seed=st.integers(0, 5),
        n_blocks=st.integers(1, 5),
    )
    def put(self, tenant: str, version: str, seed: int, n_blocks: int) -> None:
        pays = payloads(self.rng, n_blocks)
        told = len(self.view.told)
        result = self.store.put(ident(tenant, version), prompt(seed, n_blocks), pays)
        written = {c.block for c in self.view.told[told:] if c.stored}
        for h, pay in zip(result.hashes, pays, strict=True):
            if h in written:  # stored by this put (not found stored already)
                self.stored_payloads[h] = pay

    @rule(seed=st.integers(0, 5), n_keys=st.integers(1, 4))
    def put_engine_keys(self, seed: int, n_keys: int) -> None:
        keys = np.arange(n_keys * 4, dtype=np.uint32) + seed * 100 + 1
        self.store.put(ENGINE_KEYED, keys, payloads(self.rng, n_keys))

    @rule(seed=st.integers(6, 9))
    def refused_put(self, seed: int) -> None:
        """An orphan and a payload-less put: refused whole, so they tell nothing."""
        before = dict(self.view.blocks)
        with pytest.raises(OrphanBlockError):
            self.store.put(ident("a", "v1"), prompt(seed, 3), [b"x"], first_block=2)
        with pytest.raises(PayloadError):
            self.store.put(ident("a", "v1"), prompt(seed, 2), [b"x", b""])
        assert self.view.blocks == before

    @rule()
    def evict(self) -> None:
        self.store.evict(target_bytes=10 * BLOCK_BYTES)

    @rule(tenant=st.sampled_from(TENANTS))
    def purge_tenant(self, tenant: str) -> None:
        self.store.purge(PurgeSelector(tenant=tenant))

    @rule(keep=st.sampled_from(VERSIONS))
    def retire(self, keep: str) -> None:
        self.store.purge(PurgeSelector(model="m", keep={"weights": keep}))

    @rule()
    def expire(self) -> None:
        self.clock.advance(TTL_S + 1)
        self.store.reclaim_expired()

    @precondition(lambda self: bool(self.view.blocks))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(sorted(self.view.blocks)))
        self.store.delete([block])

    @precondition(lambda self: bool(set(self.stored_payloads) & set(self.view.blocks)))
    @rule(data=st.data(), repair=st.booleans())
    def damage_a_payload(self, data: st.DataObject, repair: bool) -> None:
        """A payload flipped on disk is quarantined by the load that meets it, or by repair."""
        block = data.draw(
            st.sampled_from(sorted(set(self.stored_payloads) & set(self.view.blocks)))
        )
        change = self.view.blocks[block]
        self.store.close()
        flip_in_file(self.dir / "s" / "data.mdb", self.stored_payloads.pop(block)[200:264], 32)
        self.store = open_store(self.dir / "s", self.clock)
        self.store.observe(self.view)
        if repair:
            self.store.repair()
        else:
            assert change.identity is not None
            tokens = self._tokens_up_to(block)
            out = bytearray(BLOCK_BYTES * len(tokens) // BASE.block_tokens)
            self.store.load(change.identity, tokens, out)
        assert block not in self.view.blocks and "quarantined" in self.view.reasons

    @rule()
    def restart(self) -> None:
        self.store.close()
        self.store = open_store(self.dir / "s", self.clock)
        self.store.observe(self.view)

    def _tokens_up_to(self, block: bytes) -> np.ndarray:
        """The token ids of the prompt that ends with `block`, walked up through its parents."""
        parts: list[bytes] = []
        while block in self.view.blocks:
            change = self.view.blocks[block]
            parts.append(change.tokens)
            block = change.parent
        return np.frombuffer(b"".join(reversed(parts)), dtype="<u4")

    @invariant()
    def the_view_is_the_store(self) -> None:
        held = inventory(self.store)
        assert set(self.view.blocks) == set(held)
        for h, change in held.items():
            seen = self.view.blocks[h]
            assert (seen.parent, seen.tokens, seen.identity) == (
                change.parent,
                change.tokens,
                change.identity,
            )

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


JournalMachine.TestCase.settings = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_the_observer_sees_what_the_store_holds = JournalMachine.TestCase


def test_an_aborted_transaction_tells_nothing_and_a_failing_observer_loses_no_write(
    tmp_path: Path,
) -> None:
    seen: list[BlockChange] = []

    class Failing:
        def committed(self, changes: Sequence[BlockChange]) -> None:
            seen.extend(changes)
            raise RuntimeError("the subscriber went away")

    with Store.open(tmp_path / "s", map_size=16 << 20) as store:
        store.observe(Failing())
        with pytest.raises(OrphanBlockError):
            store.put(BASE, prompt(1, 3), [b"x"], first_block=2)
        assert seen == []
        result = store.put(BASE, prompt(1, 2), [b"a" * 64, b"b" * 64])
        assert [c.block for c in seen] == list(result.hashes) and all(c.stored for c in seen)
        assert store.longest_prefix(BASE, prompt(1, 2)).n_blocks == 2  # committed all the same
        store.observe(None)
        store.delete([result.hashes[0]])
        assert len(seen) == 2  # no observer: nothing noted


class Told:
    """An observer that keeps every change it is told, in order."""

    def __init__(self) -> None:
        self.changes: list[BlockChange] = []

    def committed(self, changes: Sequence[BlockChange]) -> None:
        self.changes.extend(changes)


def test_a_block_whose_record_is_damaged_goes_under_its_identity(tmp_path: Path) -> None:
    """Its record cannot say whose it was, yet a router must hear it went: the identity is the one
    the lookup that met it read it for, so KV events name its tenant. (A repair, which reads no
    identity, tells it with none: the events then resynchronise, tests/daemon/test_events.py.)"""
    path, tokens = tmp_path / "s", prompt(1, 3)
    with Store.open(path, map_size=16 << 20) as store:
        hashes = store.put(BASE, tokens, [b"a" * 64, b"b" * 64, b"c" * 64]).hashes
    flip_in_file(path / "data.mdb", tokens[4:8].astype("<u4").tobytes(), 6)  # block 1's record
    told = Told()
    with Store.open(path, map_size=16 << 20) as store:
        store.observe(told)
        assert store.longest_prefix(BASE, tokens).n_blocks == 1
    gone = {c.block: c.identity for c in told.changes if not c.stored}
    assert gone == {hashes[1]: BASE, hashes[2]: BASE}


def at_its_commit(thread: threading.Thread) -> bool:
    """Whether `thread` is inside the journal's commit (there, waiting for its turn to tell)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "commit" and code.co_filename.endswith("journal.py"):
            return True
        frame = frame.f_back
    return False


def test_changes_are_told_in_the_order_their_transactions_committed(tmp_path: Path) -> None:
    """LMDB lets the next writer in at a commit: a removal committed after a put must not be told
    before the put's stores, or a router keeps a block the store no longer holds."""
    in_put, told_put = threading.Event(), threading.Event()

    class Slow(Told):
        def committed(self, changes: Sequence[BlockChange]) -> None:
            if changes[0].stored:  # the put's, told slowly
                in_put.set()
                assert told_put.wait(DEADLINE_S)
            super().committed(changes)

    told = Slow()
    tokens = prompt(1, 3)
    with Store.open(tmp_path / "s", map_size=16 << 20) as store:
        store.observe(told)
        put = threading.Thread(target=store.put, args=(BASE, tokens, [b"p" * 64] * 3))
        put.start()
        assert in_put.wait(DEADLINE_S)
        leaf = chain_hashes(BASE, tokens)[-1]
        delete = threading.Thread(target=store.delete, args=([leaf],))
        delete.start()
        # a store that tells out of order tells the removal and ends; one that keeps the order
        # holds the removal at its commit until the put's changes are told
        wait_for(
            lambda: not delete.is_alive() or at_its_commit(delete),
            "the removal told, or held at its commit",
        )
        told_put.set()
        put.join(DEADLINE_S)
        delete.join(DEADLINE_S)
        assert store.block_info(leaf) is None
    assert [c.stored for c in told.changes] == [True, True, True, False]


def test_the_inventory_leaves_out_blocks_past_their_tenants_time_to_live(tmp_path: Path) -> None:
    """A restart announces what a lookup can serve: a block past its tenant's time to live, not
    yet reclaimed, is no such block."""
    clock = ManualClock()
    with open_store(tmp_path / "s", clock) as store:
        store.put(ident("c", "v1"), prompt(1, 3), [b"x" * 64] * 3)
        kept = store.put(ident("a", "v1"), prompt(2, 2), [b"y" * 64] * 2).hashes
        assert len(inventory(store)) == 5
        clock.advance(TTL_S + 1)
        for batch in (1, 2, 1024):  # batches that hold expired blocks alone, or with others
            announced = [c.block for found in store.inventory(batch=batch) for c in found]
            assert sorted(announced) == sorted(kept)
        assert store.longest_prefix(ident("c", "v1"), prompt(1, 3)).n_blocks == 0
