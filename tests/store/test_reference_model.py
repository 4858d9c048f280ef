"""The store against a plain dict model under random puts, deletes, lookups and reopens."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixd import Identity, Store
from prefixd.errors import OpenTailError, OrphanBlockError

BT = 2
IDENTITY = Identity(
    model="m",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=BT,
    tenant="a",
)
# A tiny alphabet so that prompts share prefixes often.
prompts = st.lists(st.integers(0, 2), min_size=0, max_size=14)


def payload_for(prefix: tuple[int, ...]) -> bytes:
    """A payload derived from the prefix, so a wrong block is visible in its bytes."""
    return bytes(prefix) * 3 + len(prefix).to_bytes(2, "little")


class StoreModel(RuleBasedStateMachine):
    """Model: the set of stored block prefixes (tuples of token ids, block-aligned)."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="prefixd-model-"))
        self.store = Store.open(self.dir / "s", map_size=16 << 20, verify_threads=1)
        self.model: set[tuple[int, ...]] = set()

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def expected_blocks(self, tokens: list[int]) -> int:
        n = 0
        while (n + 1) * BT <= len(tokens) and tuple(tokens[: (n + 1) * BT]) in self.model:
            n += 1
        return n

    @rule(tokens=prompts, first=st.integers(0, 4), count=st.integers(0, 5))
    def put(self, tokens: list[int], first: int, count: int) -> None:
        closed = len(tokens) // BT
        data = [payload_for(tuple(tokens[: (i + 1) * BT])) for i in range(first, first + count)]
        try:
            result = self.store.put(IDENTITY, tokens, data, first_block=first)
        except OpenTailError:
            assert count and first + count > closed
            return
        except OrphanBlockError:
            assert count and first + count <= closed
            assert self.expected_blocks(tokens) < first
            return
        if not count:
            assert (result.stored, result.existed) == (0, 0)
            return
        assert first + count <= closed
        assert self.expected_blocks(tokens) >= first
        new = {tuple(tokens[: (i + 1) * BT]) for i in range(first, first + count)}
        assert result.existed == len(new & self.model)
        assert result.stored == len(new - self.model)
        self.model |= new

    @rule(tokens=prompts, count=st.integers(1, 6))
    def extend(self, tokens: list[int], count: int) -> None:
        """What an engine does: publish the blocks after the stored prefix."""
        first = self.expected_blocks(tokens)
        count = min(count, len(tokens) // BT - first)
        self.put(tokens, first, count)
        assert self.store.longest_prefix(IDENTITY, tokens).n_blocks == first + count

    @rule(tokens=prompts, at=st.integers(0, 6))
    def delete(self, tokens: list[int], at: int) -> None:
        match = self.store.longest_prefix(IDENTITY, tokens)
        if at >= match.n_blocks:
            return
        removed = self.store.delete([match.blocks[at].hash])
        root = tuple(tokens[: (at + 1) * BT])
        gone = {p for p in self.model if p[: len(root)] == root}
        assert removed == len(gone)
        self.model -= gone

    @rule(tokens=prompts)
    def lookup_and_load(self, tokens: list[int]) -> None:
        expected = self.expected_blocks(tokens)
        match = self.store.longest_prefix(IDENTITY, tokens)
        assert match.n_blocks == expected
        out = bytearray(4096)
        loaded = self.store.load(IDENTITY, tokens, out)
        assert loaded.n_blocks == expected
        for i, (offset, size) in enumerate(zip(loaded.offsets, loaded.sizes)):
            assert bytes(out[offset : offset + size]) == payload_for(tuple(tokens[: (i + 1) * BT]))

    @precondition(lambda self: len(self.model) > 0)
    @rule()
    def reopen(self) -> None:
        self.store.close()
        self.store = Store.open(self.dir / "s", create=False, verify_threads=1)

    @invariant()
    def totals_match(self) -> None:
        assert self.store.stats().blocks == len(self.model)


StoreModel.TestCase.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestStoreModel = StoreModel.TestCase


def test_store_is_consistent_after_random_work(tmp_path: Path) -> None:
    """check() finds nothing wrong after a long random run (complements the model test)."""
    import random

    rnd = random.Random(7)
    with Store.open(tmp_path / "s", map_size=32 << 20) as store:
        for _ in range(300):
            tokens = [rnd.randrange(3) for _ in range(rnd.randrange(12))]
            match = store.longest_prefix(IDENTITY, tokens)
            if rnd.random() < 0.2 and match.n_blocks:
                store.delete([match.blocks[rnd.randrange(match.n_blocks)].hash])
                continue
            closed = len(tokens) // BT
            data = [
                payload_for(tuple(tokens[: (i + 1) * BT])) for i in range(match.n_blocks, closed)
            ]
            store.put(IDENTITY, tokens, data, first_block=match.n_blocks)
            assert store.longest_prefix(IDENTITY, tokens).n_blocks == closed
        assert store.check() == []


def test_lifecycle_operations_keep_the_store_consistent(tmp_path: Path) -> None:
    """Puts, lookups, loads, deletes, purges, quota and capacity evictions, corrupt-free: after
    any mix of them every invariant check() knows holds (no orphans, counters exact)."""
    import random

    from prefixd.store import PurgeSelector

    rnd = random.Random(11)
    tenants = [Identity(**{**IDENTITY.to_dict(), "tenant": t}) for t in ("a", "b", "c")]
    with Store.open(
        tmp_path / "s", map_size=16 << 20, capacity_bytes=60_000, tenant_quota_bytes=30_000
    ) as store:
        for _ in range(400):
            identity = rnd.choice(tenants)
            tokens = [rnd.randrange(4) for _ in range(rnd.randrange(2, 16))]
            roll = rnd.random()
            if roll < 0.55:
                have = store.longest_prefix(identity, tokens).n_blocks
                closed = len(tokens) // BT
                sizes = [rnd.randrange(200, 2000) for _ in range(have, closed)]
                store.put(identity, tokens, [bytes(n) for n in sizes], first_block=have)
            elif roll < 0.75:
                store.load(identity, tokens, bytearray(1 << 16))
            elif roll < 0.85:
                match = store.longest_prefix(identity, tokens)
                if match.n_blocks:
                    store.delete([match.hashes[rnd.randrange(match.n_blocks)]])
            elif roll < 0.9:
                store.purge(PurgeSelector(tenant=identity.tenant), dry_run=rnd.random() < 0.5)
            elif roll < 0.95:
                store.evict(target_bytes=rnd.randrange(0, 60_000))
            else:
                store.purge(PurgeSelector(older_than_s=rnd.random() * 0.01))
            assert store.stats().stored_bytes <= 60_000
            for t in tenants:
                assert store.tenant_bytes(t.tenant) <= 30_000
        store.sync()
        assert store.check() == []
