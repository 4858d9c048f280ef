"""Hybrid lookups against a small reference model of the joint semantics, under random puts,
checkpoint placements, corruptions and removals: the answer always equals the model's."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixd import Identity, Store
from prefixd.errors import OpenTailError, OrphanBlockError
from prefixd.schema.chain import BlockChain
from prefixd.schema.records import chunk_key, part_key
from prefixd.schema.state import StateGroup

BT = 2
PAGE = 2  # blocks per kv page
PERIOD = 4  # tokens between 'win' checkpoints
SPEC = (
    StateGroup.paged("kv", page_blocks=PAGE),
    StateGroup.checkpoint("ssm"),
    StateGroup.checkpoint("win", policy="periodic", period_tokens=PERIOD),
)
GROUP_INDEX = {g.name: i for i, g in enumerate(SPEC)}
IDENTITY = Identity(
    model="m",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=BT,
    tenant="a",
    state=SPEC,
)
# Prompts are prefixes of these: two share their first 6 tokens (3 blocks), one shares nothing.
DOCUMENTS = ([0, 1] * 8, [0, 1, 0, 1, 0, 1, 2, 2, 1, 0, 2, 2, 1, 1, 0, 0], [2] * 16)
Prefix = tuple[int, ...]


def payload(group: str, prefix: Prefix) -> bytes:
    """Derived from the group and the prefix it hangs on, so a wrong part shows in its bytes."""
    return group.encode() + bytes(prefix) * 2 + len(prefix).to_bytes(2, "little")


def block_hash(prefix: Prefix) -> bytes:
    chain = BlockChain(IDENTITY, list(prefix))
    return chain.hash(chain.n_blocks - 1)


class JointModel(RuleBasedStateMachine):
    """Model: the stored block prefixes, the parts by (group, prefix of the block they hang on: a
    page's last block), and which parts have a flipped byte in the store."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="prefixd-joint-"))
        self.store = Store.open(self.dir / "s", map_size=16 << 20, verify_threads=1)
        self.blocks: set[Prefix] = set()
        self.parts: set[tuple[str, Prefix]] = set()
        self.corrupt: set[tuple[str, Prefix]] = set()

    def query(self, data: st.DataObject) -> list[int]:
        """A prefix of one of a few documents that share beginnings: most queries meet state."""
        document = data.draw(st.sampled_from(DOCUMENTS))
        return document[: data.draw(st.sampled_from(range(len(document), -1, -1)))]

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # --- the model -----------------------------------------------------------------------------

    def remove(self, prefix: Prefix) -> None:
        gone = {b for b in self.blocks if b[: len(prefix)] == prefix}
        self.blocks -= gone
        self.parts = {p for p in self.parts if p[1] not in gone}
        self.corrupt = {p for p in self.corrupt if p[1] not in gone}

    def below(self, prefix: Prefix, depth: int) -> Prefix | None:
        """The stored block `depth` blocks below `prefix` by first children (the smallest hash)."""
        for _ in range(depth):
            children = [b for b in self.blocks if len(b) == len(prefix) + BT]
            children = [b for b in children if b[: len(prefix)] == prefix]
            if not children:
                return None
            prefix = min(children, key=block_hash)
        return prefix

    def joint(self, tokens: list[int]) -> tuple[int, int, int, list[tuple[str, Prefix]]]:
        """(reusable, paged, matched tokens, parts to load) as the semantics define them. A page
        the prompt's stored chain ends inside is a longer stored prompt's (first children)."""
        n = 0
        while (n + 1) * BT <= len(tokens) and tuple(tokens[: (n + 1) * BT]) in self.blocks:
            n += 1

        def at(block: int) -> Prefix:
            return tuple(tokens[: (block + 1) * BT])

        pages: list[tuple[str, Prefix]] = []
        paged = n
        for start in range(0, n, PAGE):
            last = start + PAGE - 1
            hung = at(last) if last < n else self.below(at(n - 1), last - n + 1)
            if hung is None or ("kv", hung) not in self.parts:
                paged = start
                break
            pages.append(("kv", hung))
        reusable = paged
        while reusable and not all((g, at(reusable - 1)) in self.parts for g in ("ssm", "win")):
            reusable -= 1
        parts = pages[: -(-reusable // PAGE)]
        if reusable:
            parts += [("ssm", at(reusable - 1)), ("win", at(reusable - 1))]
        return reusable * BT, paged * BT, n * BT, parts

    # --- rules ---------------------------------------------------------------------------------

    @initialize(data=st.data())
    def put_the_documents(self, data: st.DataObject) -> None:
        """Start from a populated store, so that every rule meets state."""
        for document in DOCUMENTS[:2]:
            self.put(data, document)

    @rule(data=st.data())
    def put_a_prompt(self, data: st.DataObject) -> None:
        self.put(data, self.query(data))

    def put(self, data: st.DataObject, tokens: list[int]) -> None:
        closed = len(tokens) // BT
        have = self.joint(tokens)[2] // BT
        # mostly the natural continuation of what is stored, sometimes anything
        first = data.draw(st.one_of(st.just(have), st.integers(0, closed)))
        end = data.draw(st.one_of(st.just(closed - closed % PAGE), st.integers(first, closed)))
        first = min(first, end)
        snapshots = data.draw(st.sets(st.integers(1, end), max_size=3)) if end else set()
        ssm = {b * BT: payload("ssm", tuple(tokens[: b * BT])) for b in snapshots if b <= end}
        new = range((first + 1) * BT, end * BT + 1, BT)
        win = {b: payload("win", tuple(tokens[:b])) for b in new if b % PERIOD == 0}
        # the pages ending in the put's blocks
        starts = range(first // PAGE * PAGE, end, PAGE) if end > first else range(0)
        kv = [payload("kv", tuple(tokens[: (s + PAGE) * BT])) for s in starts]
        try:
            self.store.put_state(
                IDENTITY,
                tokens,
                upto_tokens=end * BT,
                first_block=first,
                paged={"kv": kv},
                checkpoints={"ssm": ssm, "win": win},
            )
        except OpenTailError:
            assert end > first and end % PAGE
            return
        except OrphanBlockError:
            assert any(tuple(tokens[: (i + 1) * BT]) not in self.blocks for i in range(first))
            return
        assert not (end > first and end % PAGE)
        assert all(tuple(tokens[: (i + 1) * BT]) in self.blocks for i in range(first))
        for i in range(first, end):
            self.blocks.add(tuple(tokens[: (i + 1) * BT]))
        for s in starts:
            self.parts.add(("kv", tuple(tokens[: (s + PAGE) * BT])))
        for group, placed in (("ssm", ssm), ("win", win)):
            self.parts.update((group, tuple(tokens[:b])) for b in placed)

    @rule(data=st.data())
    def corrupt_a_part(self, data: st.DataObject) -> None:
        if not self.parts:
            return
        group, prefix = data.draw(st.sampled_from(sorted(self.parts)))
        chain = BlockChain(IDENTITY, list(prefix))
        key = chunk_key(part_key(chain.hash(chain.n_blocks - 1), GROUP_INDEX[group]), 0)
        with self.store._ctx.env.begin(write=True) as txn:
            raw = bytearray(txn.get(key, db=self.store._ctx.tables.chunks))
            raw[0] ^= 0x01
            txn.put(key, bytes(raw), db=self.store._ctx.tables.chunks)
        self.corrupt ^= {(group, prefix)}  # a second flip restores the byte

    @rule(data=st.data())
    def delete_a_block(self, data: st.DataObject) -> None:
        if not self.blocks:
            return
        prefix = data.draw(st.sampled_from(sorted(self.blocks)))
        chain = BlockChain(IDENTITY, list(prefix))
        assert self.store.delete([chain.hash(chain.n_blocks - 1)]) == sum(
            1 for b in self.blocks if b[: len(prefix)] == prefix
        )
        self.remove(prefix)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        tokens = self.query(data)
        match = self.store.lookup_state(IDENTITY, tokens)
        reusable, paged, matched, parts = self.joint(tokens)
        assert (match.reusable_tokens, match.paged_tokens, match.matched_tokens) == (
            reusable,
            paged,
            matched,
        )
        assert match.replay_from == reusable
        assert [(p.group, p.block_index) for p in match.parts] == [
            (g, len(prefix) // BT - (PAGE if g == "kv" else 1)) for g, prefix in parts
        ]

    @rule(data=st.data())
    def load(self, data: st.DataObject) -> None:
        tokens = self.query(data)
        # the model's load: the first damaged part in load order drops its block and everything
        # below it, and the answer is worked out again; a damaged page of a longer prompt's (not
        # on this prompt's chain) is left to that prompt's reads, and this load is a miss
        while True:
            reusable, paged, matched, parts = self.joint(tokens)
            damaged = next((p for p in parts if p in self.corrupt), None)
            if damaged is None:
                break
            if damaged[1] != tuple(tokens[: len(damaged[1])]):
                reusable, paged, parts = 0, 0, []
                break
            self.remove(damaged[1])
        out = bytearray(4096)
        result = self.store.load_state(IDENTITY, tokens, out)
        match = result.match
        assert (match.reusable_tokens, match.paged_tokens, match.matched_tokens) == (
            reusable,
            paged,
            matched,
        )
        got = [
            bytes(out[offset : offset + part.payload_size])
            for part, offset in zip(match.parts, result.offsets)
        ]
        assert got == [payload(g, prefix) for g, prefix in parts]

    @invariant()
    def records_and_indexes_are_consistent(self) -> None:
        assert self.store.check(verify_payloads=False) == []


JointModel.TestCase.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)
test_joint_semantics_match_the_model = JointModel.TestCase
