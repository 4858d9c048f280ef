"""`verify --fix`: every kind of damage reported, then quarantined or rebuilt, and nothing sound
lost on the way."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from prefixd import Identity, Store
from prefixd.schema.records import AccessRecord, chunk_key
from prefixd.schema.state import StateGroup
from prefixd.store import counters


def chain(seed: int, n_blocks: int, bt: int) -> np.ndarray:
    return np.arange(n_blocks * bt, dtype=np.uint32) + seed * 100_000


def test_repair_fixes_every_kind_of_damage(tmp_path: Path, identity: Identity) -> None:
    bt = identity.block_tokens
    good, bad = chain(1, 4, bt), chain(2, 4, bt)
    hybrid = Identity.from_dict({**identity.to_dict(), "state": [StateGroup.paged("kv")]})
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        store.put(identity, good, [b"g%d" % i * 300 for i in range(4)])
        hashes = store.put(identity, bad, [b"b%d" % i * 300 for i in range(4)]).hashes
        store.put_state(hybrid, chain(3, 2, bt), paged={"kv": [b"p" * 50, b"q" * 50]})
        t = store._ctx.tables
        with store._ctx.env.begin(write=True) as txn:
            # a damaged payload chunk in block 2 of the bad chain
            key = chunk_key(hashes[2], 0)
            raw = bytearray(txn.get(key, db=t.chunks))
            raw[10] ^= 0xFF
            txn.put(key, bytes(raw), db=t.chunks)
            # a lost children-index entry, a stray one, a missing and a damaged access record
            txn.delete(hashes[0], hashes[1], db=t.children)
            txn.put(b"\x01" * 16, b"\x02" * 16, db=t.children)
            txn.delete(hashes[3], db=t.access)
            txn.put(hashes[1], b"junk", db=t.access)
            # a chunk and a part that belong to no block, and a counter gone wrong
            txn.put(chunk_key(b"\x03" * 16, 0), b"stray", db=t.chunks)
            txn.put(b"\x04" * 16 + b"\x00", b"not a part", db=t.parts)
            counters.add(txn, t.counters, counters.BLOCKS, 5)
        problems = store.check()
        kinds = {p.kind for p in problems}
        assert kinds >= {"payload", "children", "access", "chunk", "part", "counters"}

        report = store.repair()
        assert report.problems == tuple(problems)
        assert report.quarantined == 2  # the damaged block and the one below it
        assert report.fixed > 0 and report.remaining == ()
        assert store.check() == []
        # what was sound is served as before; the damaged block is gone, its ancestors are not
        out = bytearray(1 << 16)
        assert store.load(identity, good, out).n_blocks == 4
        assert store.load(identity, bad, out).n_blocks == 2
        assert store.lookup_state(hybrid, chain(3, 2, bt)).reusable_tokens == 2 * bt
        assert store.stats().quarantined == 1
        with store._ctx.env.begin() as txn:
            assert AccessRecord.decode(txn.get(hashes[1], db=t.access)).hits == 0
        # a second repair has nothing to do
        again = store.repair()
        assert (again.problems, again.quarantined, again.fixed) == ((), 0, 0)
