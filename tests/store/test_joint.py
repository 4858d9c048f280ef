"""Hybrid identities: state groups published together, found together, dropped together."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import crc32c
import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.errors import IdentityError, OpenTailError, OrphanBlockError, PayloadError
from prefixd.schema.chain import BlockChain
from prefixd.schema.records import chunk_key, part_key
from prefixd.schema.state import StateGroup
from prefixd.store.purge import PurgeSelector

from ..must_check import assert_store_checks, checks_on_teardown

BASE = {
    "model": "kimi",
    "weights": "w1",
    "tokenizer": "t",
    "template": "c",
    "rope": "r",
    "kv_layout": "bf16",
    "tenant": "a",
}


def hybrid(block_tokens: int, *groups: StateGroup, **fields: str) -> Identity:
    return Identity(**{**BASE, **fields}, block_tokens=block_tokens, state=groups)


def page(group: str, start: int) -> bytes:
    return f"{group}:page@{start}:".encode() * 3


def snap(group: str, boundary: int) -> bytes:
    return f"{group}:state@{boundary}:".encode() * 5


def pages_for(group: str, starts: range) -> list[bytes]:
    return [page(group, s) for s in starts]


@pytest.fixture
def store(tmp_path: Path, request: pytest.FixtureRequest):
    with Store.open(tmp_path / "s", map_size=64 << 20, verify_threads=1) as s:
        yield s
        if checks_on_teardown(request):
            assert_store_checks(s)


def load(store: Store, identity: Identity, tokens: np.ndarray):
    out = bytearray(1 << 20)
    result = store.load_state(identity, tokens, out)
    got = {}
    for part, offset in zip(result.match.parts, result.offsets):
        got.setdefault(part.group, []).append(bytes(out[offset : offset + part.payload_size]))
    return result.match, got


def test_design_note_scenario_joint_hit_stops_at_the_last_checkpoint(store: Store) -> None:
    """512-token hashes, 6144-token physical pages, sparse recurrent checkpoints: the paged
    match runs to 12288 tokens, but the joint hit stops at 2560, the last checkpoint."""
    ident = hybrid(
        512, StateGroup.paged("mla", page_blocks=12), StateGroup.checkpoint("kda", policy="chosen")
    )
    tokens = np.arange(12288 + 300, dtype=np.uint32)
    result = store.put_state(
        ident,
        tokens,
        upto_tokens=12288,
        paged={"mla": pages_for("mla", range(0, 24, 12))},
        checkpoints={"kda": {1024: snap("kda", 1024), 2560: snap("kda", 2560)}},
    )
    assert (result.stored, result.parts) == (24, 4)
    assert (store.stats().blocks, store.stats().parts) == (24, 4)
    match = store.lookup_state(ident, tokens)
    assert match.matched_tokens == 12288 and match.paged_tokens == 12288
    assert match.reusable_tokens == 2560 and match.replay_from == 2560
    assert [(p.group, p.first_token, p.tokens) for p in match.parts] == [
        ("mla", 0, 6144),
        ("kda", 2560, 0),
    ]
    loaded, got = load(store, ident, tokens)
    assert loaded == match
    assert got == {"mla": [page("mla", 0)], "kda": [snap("kda", 2560)]}
    # a prompt that leaves the chain inside block 5 reuses up to 2560 as well, and one that
    # leaves it inside block 4 falls back to the checkpoint at 1024
    other = tokens.copy()
    other[3000] += 1
    assert store.lookup_state(ident, other).reusable_tokens == 2560
    other[2100] += 1
    assert store.lookup_state(ident, other).reusable_tokens == 1024
    assert store.check() == []


def test_a_page_is_stored_only_when_closed(store: Store) -> None:
    ident = hybrid(4, StateGroup.paged("kv", page_blocks=3))
    tokens = np.arange(40, dtype=np.uint32)
    with pytest.raises(OpenTailError, match="not closed"):
        store.put_state(ident, tokens, upto_tokens=16, paged={"kv": [page("kv", 0), b"x"]})
    with pytest.raises(OpenTailError, match="closed blocks"):
        store.put_state(ident, tokens, upto_tokens=14, paged={"kv": [page("kv", 0)]})
    assert store.stats().blocks == 0
    store.put_state(ident, tokens, upto_tokens=12, paged={"kv": [page("kv", 0)]})
    match = store.lookup_state(ident, tokens)
    # no checkpoint groups: every stored boundary is reusable, even inside a page
    assert match.reusable_tokens == match.paged_tokens == 12
    short = tokens[:9]
    assert store.lookup_state(ident, short).reusable_tokens == 8
    assert load(store, ident, short)[1] == {"kv": [page("kv", 0)]}


def test_refused_puts_write_nothing(store: Store) -> None:
    ident = hybrid(
        4,
        StateGroup.paged("kv"),
        StateGroup.checkpoint("win", policy="periodic", period_tokens=8),
        StateGroup.checkpoint("swa", policy="none", replay_tokens=6),
    )
    tokens = np.arange(16, dtype=np.uint32)
    kv = pages_for("kv", range(4))
    win = {8: snap("win", 8), 16: snap("win", 16)}
    bad = [
        (PayloadError, {"paged": {"kv": kv[:3]}, "checkpoints": {"win": win}}),
        (PayloadError, {"paged": {"kv": kv, "nope": [b"x"]}, "checkpoints": {"win": win}}),
        (PayloadError, {"paged": {"kv": kv, "win": [b"x"]}, "checkpoints": {"win": win}}),
        (PayloadError, {"paged": {"kv": kv}, "checkpoints": {"win": {8: b"x"}}}),  # 16 missing
        (PayloadError, {"paged": {"kv": kv}, "checkpoints": {"win": {**win, 4: b"x"}}}),
        (PayloadError, {"paged": {"kv": kv}, "checkpoints": {"win": win, "swa": {8: b"x"}}}),
        (PayloadError, {"paged": {"kv": kv}, "checkpoints": {"win": {**win, 24: b"x"}}}),
        (PayloadError, {"paged": {"kv": [*kv[:3], b""]}, "checkpoints": {"win": win}}),
        (PayloadError, {"paged": {"kv": [*kv[:3], 7]}, "checkpoints": {"win": win}}),
        (OpenTailError, {"paged": {"kv": kv}, "checkpoints": {"win": {**win, 10: b"x"}}}),
    ]
    for error, kwargs in bad:
        with pytest.raises(error):
            store.put_state(ident, tokens, **kwargs)
    assert store.stats().blocks == 0 and store.stats().stored_bytes == 0
    store.put_state(ident, tokens, paged={"kv": kv}, checkpoints={"win": win})
    match = store.lookup_state(ident, tokens)
    # the 'none' group stores nothing: the engine replays 6 tokens, from the block boundary at 8
    assert (match.reusable_tokens, match.replay_from, match.paged_tokens) == (16, 8, 16)
    assert store.check() == []


def test_plain_and_hybrid_calls_do_not_mix(store: Store) -> None:
    ident = hybrid(4, StateGroup.paged("kv"))
    plain = dataclasses.replace(ident, state=None)
    tokens = np.arange(8, dtype=np.uint32)
    with pytest.raises(IdentityError, match="put_state"):
        store.put(ident, tokens, [b"a", b"b"])
    with pytest.raises(IdentityError, match="lookup_state"):
        store.longest_prefix(ident, tokens)
    with pytest.raises(IdentityError, match="load_state"):
        store.load(ident, tokens, bytearray(10))
    with pytest.raises(IdentityError, match="put"):
        store.put_state(plain, tokens, paged={"kv": [b"a", b"b"]})
    with pytest.raises(IdentityError):
        store.lookup_state(plain, tokens)
    store.put(plain, tokens, [b"a", b"b"])
    # the same prompt under the hybrid identity is another entry (the spec is in the digest)
    assert ident.digest != plain.digest
    assert store.lookup_state(ident, tokens).matched_tokens == 0


def test_a_checkpoint_attaches_only_to_a_stored_boundary(store: Store) -> None:
    ident = hybrid(4, StateGroup.paged("kv"), StateGroup.checkpoint("ssm"))
    tokens = np.arange(24, dtype=np.uint32)
    store.put_state(ident, tokens, upto_tokens=16, paged={"kv": pages_for("kv", range(4))})
    match = store.lookup_state(ident, tokens)
    assert (match.paged_tokens, match.reusable_tokens) == (16, 0)
    assert match.parts == ()
    # later: a snapshot at a stored boundary (no new blocks)
    store.put_state(
        ident, tokens, upto_tokens=16, first_block=4, checkpoints={"ssm": {8: snap("ssm", 8)}}
    )
    assert store.lookup_state(ident, tokens).reusable_tokens == 8
    # a boundary past the stored chain: its block is not stored, nothing is written
    with pytest.raises(OrphanBlockError):
        store.put_state(
            ident, tokens, upto_tokens=24, first_block=6, checkpoints={"ssm": {24: b"s"}}
        )
    # the same chain, other tokens: the checkpoint cannot attach to another prompt's boundary
    other = tokens.copy()
    other[5] = 99
    with pytest.raises(OrphanBlockError):
        store.put_state(
            ident, other, upto_tokens=16, first_block=4, checkpoints={"ssm": {16: b"s"}}
        )
    assert store.lookup_state(ident, tokens).reusable_tokens == 8
    assert store.check() == []


def test_full_policy_needs_a_window_at_every_new_boundary(store: Store) -> None:
    ident = hybrid(4, StateGroup.paged("kv"), StateGroup.checkpoint("win", policy="full"))
    tokens = np.arange(12, dtype=np.uint32)
    with pytest.raises(PayloadError, match="at token 8"):
        store.put_state(
            ident,
            tokens,
            paged={"kv": pages_for("kv", range(3))},
            checkpoints={"win": {4: b"a", 12: b"c"}},
        )
    store.put_state(
        ident,
        tokens,
        paged={"kv": pages_for("kv", range(3))},
        checkpoints={"win": {b: snap("win", b) for b in (4, 8, 12)}},
    )
    assert store.lookup_state(ident, tokens[:10]).reusable_tokens == 8
    assert load(store, ident, tokens[:10])[1]["win"] == [snap("win", 8)]


def _flip_part_payload(store: Store, block: bytes, group: int) -> None:
    with store._ctx.env.begin(write=True) as txn:
        key = chunk_key(part_key(block, group), 0)
        raw = bytearray(txn.get(key, db=store._ctx.tables.chunks))
        raw[len(raw) // 2] ^= 0x40
        txn.put(key, bytes(raw), db=store._ctx.tables.chunks)


def _flip_part_record(store: Store, block: bytes, group: int) -> None:
    with store._ctx.env.begin(write=True) as txn:
        key = part_key(block, group)
        raw = bytearray(txn.get(key, db=store._ctx.tables.parts))
        raw[12] ^= 0x01
        txn.put(key, bytes(raw), db=store._ctx.tables.parts)


def _two_checkpoints(store: Store) -> tuple[Identity, np.ndarray, list[bytes]]:
    ident = hybrid(4, StateGroup.paged("kv"), StateGroup.checkpoint("ssm"))
    tokens = np.arange(24, dtype=np.uint32)
    result = store.put_state(
        ident,
        tokens,
        paged={"kv": pages_for("kv", range(6))},
        checkpoints={"ssm": {8: snap("ssm", 8), 20: snap("ssm", 20)}},
    )
    return ident, tokens, list(result.hashes)


def test_a_damaged_checkpoint_falls_back_to_an_earlier_boundary(store: Store) -> None:
    ident, tokens, hashes = _two_checkpoints(store)
    assert store.lookup_state(ident, tokens).reusable_tokens == 20
    _flip_part_payload(store, hashes[4], 1)  # the snapshot at 20 hangs on block 4
    match, got = load(store, ident, tokens)
    assert match.reusable_tokens == 8
    assert got == {"kv": pages_for("kv", range(2)), "ssm": [snap("ssm", 8)]}
    # the damaged boundary and everything after it are gone, counted, and the store is clean
    assert store.lookup_state(ident, tokens).matched_tokens == 16
    assert store.stats().quarantined == 1
    assert store.check() == []


def test_a_damaged_page_makes_the_entry_unreachable_from_its_start(store: Store) -> None:
    ident, tokens, hashes = _two_checkpoints(store)
    _flip_part_payload(store, hashes[3], 0)
    match, _ = load(store, ident, tokens)
    assert (match.reusable_tokens, match.matched_tokens) == (8, 12)
    assert store.check() == []


def test_an_exported_block_carries_its_verified_parts(store: Store) -> None:
    """What the shared tier publishes of a hybrid block: its record with every part hung on it,
    verified; a damaged part makes it unexportable, and quarantines it."""
    ident, tokens, hashes = _two_checkpoints(store)
    exported = store.export_block(hashes[4])
    assert exported is not None and exported.payload == b""
    assert exported.parts == ((0, page("kv", 4)), (1, snap("ssm", 20)))
    middle = store.export_block(hashes[3])
    assert middle is not None and middle.parts == ((0, page("kv", 3)),)
    _flip_part_payload(store, hashes[4], 1)
    assert store.export_block(hashes[4]) is None
    assert store.stats().quarantined == 1
    assert store.lookup_state(ident, tokens).reusable_tokens == 8
    assert store.check() == []


def test_a_damaged_part_record_is_found_by_the_lookup(store: Store) -> None:
    ident, tokens, hashes = _two_checkpoints(store)
    _flip_part_record(store, hashes[4], 1)
    assert "part" in {p.kind for p in store.check()}
    assert store.lookup_state(ident, tokens).reusable_tokens == 8
    assert store.check() == []


def test_eviction_takes_whole_parts_and_shrinks_the_joint_hit(tmp_path: Path) -> None:
    ident = hybrid(4, StateGroup.paged("kv"), StateGroup.checkpoint("ssm"))
    tokens = np.arange(32, dtype=np.uint32)
    big = bytes(16 << 10)
    with Store.open(tmp_path / "s", map_size=64 << 20, verify_threads=1) as store:
        store.put_state(
            ident,
            tokens,
            paged={"kv": [big] * 8},
            checkpoints={"ssm": {12: big, 32: big}},
        )
        before = store.stats().stored_bytes
        assert before >= 10 * len(big)
        report = store.evict(before - 3 * len(big))
        assert report.blocks >= 1 and report.stored_bytes >= 3 * len(big)
        match = store.lookup_state(ident, tokens)
        assert match.reusable_tokens == 12
        assert store.check() == []


def test_purging_a_tenant_removes_its_parts(store: Store) -> None:
    ident, tokens, _ = _two_checkpoints(store)
    other = dataclasses.replace(ident, tenant="b")
    store.put_state(
        other,
        tokens,
        upto_tokens=8,
        paged={"kv": pages_for("kv", range(2))},
        checkpoints={"ssm": {8: snap("ssm", 8)}},
    )
    report = store.purge(PurgeSelector(tenant="a"))
    assert report.blocks == 6
    with store._ctx.env.begin() as txn:
        assert txn.stat(store._ctx.tables.parts)["entries"] == 3
    assert store.lookup_state(ident, tokens).matched_tokens == 0
    assert store.lookup_state(other, tokens).reusable_tokens == 8
    assert store.check() == []


def test_identity_state_spec_round_trips_and_validates() -> None:
    ident = hybrid(
        512,
        StateGroup.paged("mla", page_blocks=12),
        StateGroup.checkpoint("swa", policy="periodic", period_tokens=2048),
        StateGroup.checkpoint("kda"),
    )
    assert Identity.decode(ident.encode()) == ident
    assert Identity.from_dict(ident.to_dict()) == ident
    assert ident.to_dict()["state"][0] == {
        "name": "mla",
        "kind": "paged",
        "page_blocks": 12,
        "policy": "full",
        "period_tokens": 0,
        "replay_tokens": 0,
    }
    # every setting is part of the digest
    variants = [
        hybrid(512, StateGroup.paged("mla", page_blocks=6)),
        hybrid(512, StateGroup.paged("mla", page_blocks=12)),
        hybrid(512, StateGroup.paged("kv", page_blocks=12)),
        hybrid(512, StateGroup.checkpoint("mla")),
        hybrid(512, StateGroup.checkpoint("mla", policy="full")),
        hybrid(512, StateGroup.checkpoint("mla", policy="none", replay_tokens=4096)),
    ]
    assert len({v.digest for v in variants}) == len(variants)
    invalid = [
        (StateGroup.checkpoint("s", policy="periodic", period_tokens=100),),
        (StateGroup.checkpoint("s", policy="sometimes"),),
        (StateGroup("s", "paged", page_blocks=0),),
        (StateGroup("s", "ring"),),
        (StateGroup.paged("s"), StateGroup.checkpoint("s")),
        (),
        (StateGroup.checkpoint("s", replay_tokens=5),),
    ]
    for groups in invalid:
        with pytest.raises(IdentityError):
            hybrid(512, *groups)
    with pytest.raises(IdentityError):
        Identity.from_dict(
            {**ident.to_dict(), "state": [{"name": "x", "kind": "paged", "colour": 1}]}
        )


def put_four_pages_and_a_checkpoint(store: Store, ident: Identity, tokens: np.ndarray) -> None:
    """A kv page per block of four and a rec checkpoint at token 16: five parts."""
    store.put_state(
        ident,
        tokens,
        paged={"kv": pages_for("kv", range(0, 16, 4))},
        checkpoints={"rec": {16: snap("rec", 16)}},
    )


def test_a_state_read_cut_off_at_its_deadline_is_a_miss(tmp_path: Path, monkeypatch) -> None:
    """Slow storage: the read of the first page stalls past the load's deadline. A state needs
    every group at one boundary, so the answer is a miss (nothing reported, the destination
    zeroed), counted as a cut-off, never a failure or a quarantine; without the stall the same
    load answers the whole state."""
    from prefixd.clock import ManualClock
    from prefixd.store import codec

    clock = ManualClock()
    ident = hybrid(4, StateGroup.paged("kv", page_blocks=1), StateGroup.checkpoint("rec"))
    tokens = np.arange(16, dtype=np.uint32)
    original = codec._copy_and_checksum

    def stalled_at_the_first_page(chunks: list[memoryview], dest: memoryview) -> int:
        value = original(chunks, dest)
        if bytes(chunks[0][: len(page("kv", 0))]) == page("kv", 0):
            clock.advance(10.0)  # this read took ten seconds
        return value

    with Store.open(tmp_path / "s", map_size=64 << 20, clock=clock, verify_threads=0) as store:
        put_four_pages_and_a_checkpoint(store, ident, tokens)
        monkeypatch.setattr(codec, "_copy_and_checksum", stalled_at_the_first_page)
        out = bytearray(b"\xaa") * 4096
        cut = store.load_state(ident, tokens, out, deadline=clock.monotonic() + 5.0)
        assert (cut.match.reusable_tokens, cut.match.parts, cut.offsets) == (0, (), ())
        stats = store.stats()
        assert (stats.deadline_cutoffs, stats.verify_failures, stats.quarantined) == (1, 0, 0)
        assert not any(out[: store.lookup_state(ident, tokens).payload_bytes])
        monkeypatch.setattr(codec, "_copy_and_checksum", original)
        whole = store.load_state(ident, tokens, out, deadline=clock.monotonic() + 5.0)
        assert whole.match.reusable_tokens == 16 and len(whole.match.parts) == 5
        assert store.check() == []


def test_a_state_whose_destination_changed_during_the_load_is_a_miss(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client writing into its region while a part is copied there fails that copy with the
    stored bytes intact: nothing is quarantined, and a state read in part is a miss (nothing
    reported, the destination zeroed), never the whole hit with no state loaded."""
    from prefixd.store import codec

    ident = hybrid(4, StateGroup.paged("kv", page_blocks=1), StateGroup.checkpoint("rec"))
    tokens = np.arange(16, dtype=np.uint32)
    original = codec._copy_and_checksum

    def copy_then_scribbled(chunks: list[memoryview], dest: memoryview) -> int:
        value = original(chunks, dest)
        if bytes(chunks[0][: len(page("kv", 8))]) == page("kv", 8):  # the client writes there
            dest[0] ^= 0xFF
            return int(crc32c.crc32c(dest[: sum(c.nbytes for c in chunks)]))
        return value

    with Store.open(tmp_path / "s", map_size=64 << 20, compression="none") as store:
        put_four_pages_and_a_checkpoint(store, ident, tokens)
        monkeypatch.setattr(codec, "_copy_and_checksum", copy_then_scribbled)
        out = bytearray(b"\xaa") * 4096
        changed = store.load_state(ident, tokens, out)
        assert (changed.match.reusable_tokens, changed.match.parts, changed.offsets) == (0, (), ())
        stats = store.stats()
        assert (stats.quarantined, stats.destinations_changed) == (0, 1)
        assert not any(out[: store.lookup_state(ident, tokens).payload_bytes])
        monkeypatch.setattr(codec, "_copy_and_checksum", original)
        assert store.load_state(ident, tokens, out).match.reusable_tokens == 16
        assert store.check() == []


def test_prompts_that_part_inside_a_page_never_share_it(store: Store) -> None:
    """A page of two blocks holds both blocks' KV: a prompt that shares only its first block
    must not be served it, whether it was put beside it or after the other's second block went."""
    ident = hybrid(4, StateGroup.paged("kv", page_blocks=2))
    a = np.arange(8, dtype=np.uint32)
    b = a.copy()
    b[4:] += 100  # block 0 shared, block 1 not
    store.put_state(ident, a, paged={"kv": [b"the KV of a's blocks 0 and 1"]})
    assert store.put_state(ident, b, paged={"kv": [b"the KV of b's blocks 0 and 1"]}).parts == 1
    match, got = load(store, ident, b)
    assert (match.reusable_tokens, got) == (8, {"kv": [b"the KV of b's blocks 0 and 1"]})
    store.delete([BlockChain(ident, b).hash(1)])  # b's second block goes, and its page with it
    assert load(store, ident, b)[1] == {"kv": [b"the KV of a's blocks 0 and 1"]}  # block 0 alone
    assert load(store, ident, b)[0].reusable_tokens == 4  # a byte prefix of a's page
    c = a.copy()
    c[4:] += 200
    with pytest.raises(PayloadError, match="ending in blocks 1..1"):
        store.put_state(ident, c, paged={}, first_block=1)  # block 1 would close c's own page
    assert load(store, ident, a)[1] == {"kv": [b"the KV of a's blocks 0 and 1"]}
