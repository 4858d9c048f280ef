"""Hybrid identities through the shared tier: a block's state-group parts travel with it, are
proven with it and installed with it, all groups or none, by the local joint rules."""

from __future__ import annotations

import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.cluster.blocks import block_key, decode_block, encode_block
from prefixd.cluster.bridge import SharedTierBridge
from prefixd.cluster.runs import batches
from prefixd.errors import RemoteBlockError
from prefixd.schema.chain import BlockChain
from prefixd.schema.state import StateGroup
from tests.waiting import wait_for

from .memory_tier import MemoryTier, Nodes, nodes  # noqa: F401 (a fixture)

BT = 16
HYBRID = Identity(
    model="kimi-linear",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=BT,
    tenant="acme",
    state=(
        StateGroup.paged("mla", page_blocks=2),
        StateGroup.checkpoint("kda", policy="full"),
    ),
)
BLOCKS = 8
TOKENS = np.arange(BT * BLOCKS + 5, dtype=np.uint32) + 700_000  # an open tail of 5 tokens


def page(start: int) -> bytes:
    return f"mla page @{start};".encode() * 900


def snap(boundary: int) -> bytes:
    return f"kda state @{boundary};".encode() * 700


def put_all(store: Store, bridge: SharedTierBridge, tier: MemoryTier) -> None:
    result = store.put_state(
        HYBRID,
        TOKENS,
        upto_tokens=BLOCKS * BT,
        paged={"mla": [page(s) for s in range(0, BLOCKS, 2)]},
        checkpoints={"kda": {b: snap(b) for b in range(BT, BLOCKS * BT + 1, BT)}},
    )
    bridge.published(HYBRID, result.hashes)
    wait_for(lambda: len(tier.objects) >= BLOCKS, "every block published", poll_s=0.01)


def state_of(store: Store, tokens: np.ndarray = TOKENS) -> tuple[int, dict[str, list[bytes]]]:
    out = bytearray(1 << 20)
    result = store.load_state(HYBRID, tokens, out)
    got: dict[str, list[bytes]] = {}
    for part, offset in zip(result.match.parts, result.offsets, strict=True):
        got.setdefault(part.group, []).append(bytes(out[offset : offset + part.payload_size]))
    return result.match.reusable_tokens, got


def test_a_hybrid_block_travels_with_its_parts(nodes: Nodes) -> None:
    tier, (a, b), (bridge_a, bridge_b) = nodes
    put_all(a, bridge_a, tier)
    assert state_of(b)[0] == 0
    assert bridge_b.read_through(HYBRID, TOKENS, 0) == BLOCKS
    assert state_of(b) == state_of(a)
    reusable, got = state_of(b)
    assert reusable == BLOCKS * BT
    assert got == {"mla": [page(s) for s in range(0, BLOCKS, 2)], "kda": [snap(BLOCKS * BT)]}
    assert bridge_b.snapshot()["remote_bytes"] == sum(
        len(page(s)) for s in range(0, BLOCKS, 2)
    ) + sum(len(snap(b)) for b in range(BT, BLOCKS * BT + 1, BT))


@pytest.mark.parametrize(
    ("block", "group", "installed"),
    [(5, 1, 4), (5, 0, 4), (1, 0, 0), (1, 1, 0)],
    ids=["checkpoint-of-block-5", "page-of-blocks-4-5", "first-page", "checkpoint-of-block-1"],
)
def test_a_tampered_part_takes_its_block_and_all_after_it_away(
    nodes: Nodes, block: int, group: int, installed: int
) -> None:
    """One byte of one part flipped in the tier: nothing from its block on is installed, and
    what is installed ends where every page is closed and every checkpoint is there."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    put_all(a, bridge_a, tier)
    key = block_key(HYBRID, BlockChain(HYBRID, TOKENS).hash(block))
    value = bytearray(tier.objects[key])
    spans = _part_spans(value)
    value[spans[group][0] + 3] ^= 0x40
    tier.objects[key] = bytes(value)
    assert bridge_b.read_through(HYBRID, TOKENS, 0) == installed
    assert bridge_b.snapshot()["remote_verify_failures"] == 1
    reusable, got = state_of(b)
    assert reusable == installed * BT
    if installed:
        assert got["mla"] == [page(s) for s in range(0, installed, 2)]
        assert got["kda"] == [snap(installed * BT)]


def _part_spans(value: bytearray) -> dict[int, tuple[int, int]]:
    """Where each part's payload lies in a value (by the header's table)."""
    import struct

    n_parts, record_len, payload_len = value[5], *struct.unpack_from("<II", value, 8)
    table = [struct.unpack_from("<B3xII", value, 20 + 12 * i) for i in range(n_parts)]
    offset = 20 + 12 * n_parts + record_len + payload_len
    spans = {}
    for group, length, _ in table:
        spans[group] = (offset, offset + length)
        offset += length
    return spans


CHOSEN = Identity(
    **{
        **HYBRID.to_dict(),
        "state": (StateGroup.paged("mla", page_blocks=2), StateGroup.checkpoint("kda")),
    }
)  # checkpoints where the engine chooses


def put_sparse(store: Store, bridge: SharedTierBridge, tier: MemoryTier) -> None:
    """Four blocks of CHOSEN, one checkpoint at block 2, published."""
    result = store.put_state(
        CHOSEN,
        TOKENS,
        upto_tokens=4 * BT,
        paged={"mla": [page(0), page(2)]},
        checkpoints={"kda": {2 * BT: snap(2 * BT)}},
    )
    bridge.published(CHOSEN, result.hashes)
    wait_for(lambda: len(tier.objects) >= 4, "every block published", poll_s=0.01)


def test_a_checkpoint_hung_later_replaces_the_published_value(nodes: Nodes) -> None:
    """Published without a checkpoint at block 3 (policy 'chosen'), the chain is reusable
    only to block 2 elsewhere; once one is hung on it and published again, to block 4."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    put_sparse(a, bridge_a, tier)
    assert bridge_b.read_through(CHOSEN, TOKENS[: 4 * BT], 0) == 4
    assert b.lookup_state(CHOSEN, TOKENS).reusable_tokens == 2 * BT
    hashes = BlockChain(CHOSEN, TOKENS).hashes_until(4)
    a.put_state(
        CHOSEN, TOKENS, upto_tokens=4 * BT, first_block=4, checkpoints={"kda": {64: snap(64)}}
    )
    before = tier.objects[block_key(CHOSEN, hashes[3])]
    bridge_a.published(CHOSEN, [hashes[3]])
    wait_for(
        lambda: tier.objects[block_key(CHOSEN, hashes[3])] != before,
        "the block published again",
        poll_s=0.01,
    )
    b.delete([hashes[0]])
    assert bridge_b.read_through(CHOSEN, TOKENS[: 4 * BT], 0) == 4
    assert b.lookup_state(CHOSEN, TOKENS).reusable_tokens == 4 * BT


def test_a_query_ending_inside_a_page_installs_up_to_the_last_closed_one(nodes: Nodes) -> None:
    tier, (a, b), (bridge_a, bridge_b) = nodes
    put_all(a, bridge_a, tier)
    assert bridge_b.read_through(HYBRID, TOKENS[: 7 * BT + 3], 0) == 6
    assert state_of(b)[0] == 6 * BT


def test_batches_end_where_pages_close(nodes: Nodes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of about three blocks over pages of two: each ends on a page boundary, so each
    is installed alone, and a read-through from inside a page goes on from there."""
    from prefixd.cluster import bridge as bridge_module

    assert batches(0, 8, 3, 2) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert batches(3, 8, 3, 2) == [(3, 6), (6, 8)]
    assert batches(1, 9, 1, 4) == [(1, 4), (4, 8), (8, 9)]
    monkeypatch.setattr(bridge_module, "_BATCH_BYTES", 3 * 16_000)
    tier, (a, b), (bridge_a, bridge_b) = nodes
    put_all(a, bridge_a, tier)
    tier.calls.clear()
    assert bridge_b.read_through(HYBRID, TOKENS, 0) == BLOCKS
    assert tier.calls["get_many_into"] == 4
    assert state_of(b) == state_of(a)


def test_parts_are_proven_where_they_hang() -> None:
    """A part the identity's spec has no place for is refused like a damaged one: a page off
    a page's last block, a group the spec does not have, a group twice, any part for a plain
    identity."""
    chain = BlockChain(HYBRID, TOKENS)
    from prefixd.schema.records import BlockRecord, Compression

    def value(index: int, parts: list[tuple[int, bytes]]) -> bytes:
        record = BlockRecord(
            Compression.NONE,
            0,
            0,
            0,
            0,
            0,
            1,
            HYBRID.digest,
            chain.parent_of(index),
            bytes(chain.block_bytes(index)),
        ).encode()
        return encode_block(record, b"", parts)

    def decode(index: int, parts: list[tuple[int, bytes]], spec: object = HYBRID.state) -> object:
        return decode_block(
            value(index, parts),
            identity_digest=HYBRID.digest,
            parent=chain.parent_of(index),
            tokens=bytes(chain.block_bytes(index)),
            spec=spec,  # type: ignore[arg-type]
            block_index=index,
            block_tokens=BT,
        )

    got = decode(3, [(0, b"page"), (1, b"snap")])
    parts = got.parts  # type: ignore[attr-defined]
    assert {g: bytes(p) for g, p in parts.items()} == {0: b"page", 1: b"snap"}
    assert decode(2, [(1, b"snap")]).parts.keys() == {1}  # type: ignore[attr-defined]
    for index, parts, spec in [
        (2, [(0, b"page")], HYBRID.state),  # block 2 ends no page
        (2, [(2, b"x")], HYBRID.state),  # no group 2
        (2, [(1, b"a"), (1, b"b")], HYBRID.state),  # group 1 twice
        (2, [(0, b"page")], None),  # a plain identity's block has no parts
        (2, [(0, b"")], HYBRID.state),  # an empty part
    ]:
        with pytest.raises(RemoteBlockError):
            decode(index, parts, spec)


def test_a_prompt_the_tier_did_not_extend_is_not_asked_again_at_once(nodes: Nodes) -> None:
    """Sparse checkpoints (policy 'chosen'): B's joint boundary stays at block 2 while blocks
    2 and 3 are stored. A read-through from there that brings nothing is not repeated by every
    lookup, only after `_RECHECK_S` (on the bridge's clock)."""
    from prefixd.cluster.bridge import _RECHECK_S

    tier, (a, _b), (bridge_a, bridge_b) = nodes
    clock = [1000.0]
    bridge_b._now = lambda: clock[0]
    put_sparse(a, bridge_a, tier)
    prompt = TOKENS[: 4 * BT]
    assert bridge_b.read_through(CHOSEN, prompt, 0) == 4
    assert bridge_b.read_through(CHOSEN, prompt, 2) == 0  # blocks 2, 3 again: nothing new
    tier.calls.clear()
    assert bridge_b.read_through(CHOSEN, prompt, 2) == 0
    assert sum(tier.calls.values()) == 0
    assert bridge_b.snapshot()["remote_skipped_recently"] == 1
    clock[0] += _RECHECK_S + 1
    assert bridge_b.read_through(CHOSEN, prompt, 2) == 0
    assert tier.calls["get_many_into"] == 1  # asked again, once the time is up


def test_a_boundary_inside_a_page_reads_through_when_the_next_page_is_not_shared(
    nodes: Nodes,
) -> None:
    """B's joint boundary is at block 3, inside the page of blocks 2-3; the tier has blocks 0-3
    with a checkpoint at every boundary, and no block 4. Sized by block 3 when block 4 is not
    there, the fetch brings block 3's checkpoint: B's boundary moves to block 4."""
    tier, (a, b), (bridge_a, bridge_b) = nodes
    chosen = CHOSEN
    pages = {"mla": [page(0), page(2)]}
    every = {"kda": {b: snap(b) for b in range(BT, 4 * BT + 1, BT)}}
    result = a.put_state(chosen, TOKENS, upto_tokens=4 * BT, paged=pages, checkpoints=every)
    bridge_a.published(chosen, result.hashes)
    wait_for(lambda: len(tier.objects) >= 4, "every block published", poll_s=0.01)
    b.put_state(
        chosen, TOKENS, upto_tokens=4 * BT, paged=pages, checkpoints={"kda": {48: snap(48)}}
    )
    assert b.lookup_state(chosen, TOKENS).reusable_tokens == 3 * BT
    assert bridge_b.read_through(chosen, TOKENS, 3) == 1
    assert b.lookup_state(chosen, TOKENS).reusable_tokens == 4 * BT
