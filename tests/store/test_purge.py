"""Purges: tenants, retired model versions, idle blocks, everything; dry runs change nothing."""

from __future__ import annotations

from pathlib import Path

import lmdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixd import Identity, Store
from prefixd.clock import ManualClock
from prefixd.errors import ConfigError, IdentityError
from prefixd.store import PurgeSelector

from ..needles import Needles

BASE = {
    "model": "m",
    "weights": "w1",
    "tokenizer": "t",
    "template": "c",
    "rope": "r",
    "kv_layout": "bf16",
    "block_tokens": 4,
    "tenant": "a",
}
PROMPT = list(range(100, 120))  # five blocks


def ident(**changes: object) -> Identity:
    return Identity(**{**BASE, **changes})


def fill(store: Store, identity: Identity, prompt: list[int] = PROMPT, size: int = 100) -> None:
    store.put(identity, prompt, [bytes([len(prompt) % 256]) * size] * (len(prompt) // 4))


def scan_digests(path: Path) -> set[bytes]:
    """Every identity digest that any record, index entry or identity row still names."""
    env = lmdb.open(str(path), max_dbs=16, readonly=True)
    names: set[bytes] = set()
    from prefixd.schema.records import BlockRecord

    with env.begin() as txn:
        for _key, value in txn.cursor(db=env.open_db(b"blocks", txn=txn, create=False)):
            names.add(BlockRecord.decode(value).identity)
        for key, _ in txn.cursor(db=env.open_db(b"identities", txn=txn, create=False)):
            names.add(bytes(key))
        for key, _ in txn.cursor(db=env.open_db(b"children", txn=txn, create=False)):
            names.add(bytes(key))
    env.close()
    return names


def test_a_tenant_purge_leaves_no_trace(tmp_path: Path) -> None:
    a, a_lora, b = ident(), ident(adapter="lora@1"), ident(tenant="b")
    with Store.open(tmp_path / "s") as store:
        for identity in (a, a_lora, b):
            fill(store, identity)
            fill(store, identity, PROMPT[:8] + [7] * 12)
        report = store.purge(PurgeSelector(tenant="a"))
        assert (report.identities, report.blocks) == (2, 2 * 8)
        assert report.payload_bytes == 16 * 100 and not report.dry_run
        assert store.longest_prefix(a, PROMPT).n_blocks == 0
        assert store.longest_prefix(a_lora, PROMPT).n_blocks == 0
        assert store.longest_prefix(b, PROMPT).n_blocks == 5  # identical prompt, other tenant
        assert store.check() == []
        assert store.stats().blocks == 8 and store.stats().identities == 1
    names = scan_digests(tmp_path / "s")
    assert a.digest not in names and a_lora.digest not in names and b.digest in names
    files = b"".join(path.read_bytes() for path in (tmp_path / "s").iterdir())
    for gone in (a, a_lora):  # nor in the files: neither the digests nor the identity rows
        assert gone.digest not in files and gone.encode() not in files
    assert b.digest in files and b.encode() in files


def test_a_damaged_record_below_the_root_is_charged_to_its_identity(tmp_path: Path) -> None:
    """A record too damaged to name its identity still goes with its subtree's: the per-identity
    counters and the removal tallies count it, so a purged tenant leaves no bytes behind."""
    a = ident()
    with Store.open(tmp_path / "s") as store:
        fill(store, a, PROMPT[:16])
        last = store.longest_prefix(a, PROMPT[:16]).hashes[3]
        with store._ctx.env.begin(write=True) as txn:  # bit rot in block 3's record
            raw = bytearray(txn.get(last, db=store._ctx.tables.blocks))
            raw[-10] ^= 0xFF
            txn.put(last, bytes(raw), db=store._ctx.tables.blocks)
        assert store.purge(PurgeSelector(tenant="a")).blocks == 4
        assert "a" not in store.tenant_totals()
        assert store.removals()["a"]["purged"] == 4
        assert store.check() == []


def test_a_tenant_purge_leaves_nothing_of_it_in_memory(tmp_path: Path) -> None:
    """Nor in the store's memory: the prompts the lookup memo kept (token ids) and the tenant's
    name in the tenant index go with the purge, not at some later eviction."""
    a, b = ident(), ident(tenant="b")
    with Store.open(tmp_path / "s") as store:
        for identity in (a, b):
            fill(store, identity)
            assert store.longest_prefix(identity, PROMPT).n_blocks == 5  # remembered
        store.purge(PurgeSelector(tenant="a"))
        assert {entry.identity for entry in store._ctx.memo._entries.values()} == {b.digest}
        assert a.digest not in store._ctx.tenants._memo


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_tenant_purge_leaves_no_byte_in_any_file(tmp_path: Path, compression: str) -> None:
    """The purged tenant's payloads, token ids, engine keys and name are in no file of the store
    once the purge returns, its entries having shared pages with another tenant's; the other
    tenant's load exactly, then and after more puts."""
    needles = Needles(seed=7)
    victim = needles.name("victim-7f3a9c")
    token_keyed = ident(tenant=victim, block_tokens=4)
    keyed = ident(tenant=victim, block_tokens=4, key_bytes=36)
    other, other_keyed = ident(tenant="b"), ident(tenant="b", key_bytes=36)
    kept = []
    with Store.open(tmp_path / "s", compression=compression, map_size=256 << 20) as store:
        for n in range(60):  # interleaved: the two tenants' records share leaf pages
            size = (700, 3000, 9000)[n % 3]  # in a leaf, one overflow page, several
            store.put(token_keyed, needles.tokens(token_keyed, 3), needles.payloads(3, size))
            store.put(keyed, needles.keys(keyed, 2), needles.payloads(2, size))
            tokens = needles.tokens(other, 3, planted=False)
            payloads = needles.payloads(3, size, planted=False)
            store.put(other, tokens, payloads)
            kept.append((tokens, payloads))
        store.sync()
        assert needles.found(tmp_path / "s")["data.mdb"] > 1000  # the scan finds them
        report = store.purge(PurgeSelector(tenant=victim))
        assert report.blocks == 60 * 5
        assert needles.found(tmp_path / "s") == {}
        assert report.cleared is not None and report.cleared.complete
        assert all(loads_exactly(store, other, tokens, payloads) for tokens, payloads in kept)
        for _ in range(20):  # later writes bring nothing back
            store.put(
                other_keyed, needles.rng.bytes(36 * 2), needles.payloads(2, 3000, planted=False)
            )
        store.sync()
        assert needles.found(tmp_path / "s") == {}
        assert store.check() == []
    assert needles.found(tmp_path / "s") == {}


def loads_exactly(store: Store, identity: Identity, tokens: object, payloads: list[bytes]) -> bool:
    out = bytearray(sum(map(len, payloads)))
    loaded = store.load(identity, tokens, out)
    got = [bytes(out[o : o + n]) for o, n in zip(loaded.offsets, loaded.sizes)]
    return got == payloads


def test_loads_of_other_tenants_go_on_while_the_files_are_cleared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clearing holds the writer's lock for its walk over the file: a load of another tenant
    started then is answered before the walk ends."""
    import threading

    from prefixd.store import scrub

    needles = Needles(seed=8)
    other = ident(tenant="b")
    tokens, payloads = needles.tokens(other, 4, planted=False), needles.payloads(4, 3000)
    answers: list[bool] = []
    real_run = scrub._Walk.run

    def run_while_loading(walk: scrub._Walk, oldest: float, last: int) -> bool:
        loader = threading.Thread(
            target=lambda: answers.append(loads_exactly(store, other, tokens, payloads))
        )
        loader.start()
        loader.join(30)  # the walk waits for the load: a load that waited on it never ends
        return real_run(walk, oldest, last)

    monkeypatch.setattr(scrub._Walk, "run", run_while_loading)
    with Store.open(tmp_path / "s") as store:
        store.put(other, tokens, payloads)
        fill(store, ident())
        store.purge(PurgeSelector(tenant="a"))
    assert answers == [True]


@pytest.mark.parametrize("scrub_retired", [True, False])
def test_a_retired_version_is_cleared_with_scrub_retired(
    tmp_path: Path, scrub_retired: bool
) -> None:
    needles = Needles(seed=9)
    old, new = ident(weights="w1"), ident(weights="w2")
    with Store.open(tmp_path / "s", scrub_retired=scrub_retired) as store:
        for _ in range(20):
            store.put(old, needles.tokens(old, 3), needles.payloads(3, 3000))
            store.put(
                new, needles.tokens(new, 3, planted=False), needles.payloads(3, 3000, planted=False)
            )
        report = store.purge(PurgeSelector(model="m", keep={"weights": "w2"}))
        assert report.blocks == 60
        store.sync()
        left = needles.found(tmp_path / "s")
    if scrub_retired:
        assert report.cleared is not None and left == {}
    else:  # as before: nothing is cleared, nothing spent on it
        assert report.cleared is None and left["data.mdb"] > 0


def test_tenants_with_identical_prompts_never_share(store: Store) -> None:
    a, b = ident(), ident(tenant="b")
    fill(store, a)
    assert store.longest_prefix(b, PROMPT).n_blocks == 0
    fill(store, b)
    assert store.put(b, PROMPT, [b"x"] * 5).existed == 5
    assert store.stats().blocks == 10  # two copies: no deduplication across tenants


def test_retiring_a_model_keeps_the_named_version(store: Store) -> None:
    old, new, other = ident(weights="w1"), ident(weights="w2"), ident(model="m2")
    for identity in (old, new, other):
        fill(store, identity)
    report = store.purge(PurgeSelector(model="m", keep={"weights": "w2"}))
    assert (report.identities, report.blocks) == (1, 5)
    assert store.longest_prefix(old, PROMPT).n_blocks == 0
    assert store.longest_prefix(new, PROMPT).n_blocks == 5
    assert store.longest_prefix(other, PROMPT).n_blocks == 5


def test_retiring_other_versioned_fields(store: Store) -> None:
    for layout in ("bf16", "fp8"):
        for template in ("c1", "c2"):
            fill(store, ident(kv_layout=layout, template=template))
    report = store.purge(PurgeSelector(model="m", keep={"kv_layout": "fp8", "template": "c2"}))
    assert report.identities == 1  # only bf16 + c1: a kept version of either field survives
    assert store.stats().blocks == 15


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        fill(store, ident())
        fill(store, ident(), PROMPT[:8] + [9] * 8)
        store.sync()
        before = (tmp_path / "s" / "data.mdb").read_bytes()
        report = store.purge(PurgeSelector(tenant="a"), dry_run=True)
        assert report.dry_run and (report.identities, report.blocks) == (1, 7)
        assert report.payload_bytes == 7 * 100
        assert store.stats().blocks == 7
        assert (tmp_path / "s" / "data.mdb").read_bytes() == before


def test_older_than_removes_idle_subtrees_only(tmp_path: Path) -> None:
    identity = ident()
    clock = ManualClock()
    with Store.open(tmp_path / "s", map_size=64 << 20, clock=clock) as store:
        fill(store, identity)
        fill(store, identity, PROMPT[:8] + [5] * 12)
        clock.advance(0.2)
        store.longest_prefix(identity, PROMPT)  # keeps PROMPT's blocks fresh, the branch idles
        report = store.purge(PurgeSelector(older_than_s=0.1))
        assert report.blocks == 3
        assert store.longest_prefix(identity, PROMPT).n_blocks == 5
        assert store.longest_prefix(identity, PROMPT[:8] + [5] * 12).n_blocks == 2
        assert store.check() == []


def test_everything(store: Store) -> None:
    fill(store, ident())
    fill(store, ident(tenant="b"))
    assert store.purge(PurgeSelector(everything=True)).blocks == 10
    assert store.stats().blocks == 0 and store.stats().identities == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"keep": {"weights": "v"}},
        {"tenant": "a", "everything": True},
        {"model": "m", "keep": {"tenant": "a"}},
        {"older_than_s": -1.0},
        {"older_than_s": float("nan")},
        {"older_than_s": float("inf")},
        {"older_than_s": 1e300},
    ],
)
def test_bad_selectors(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        PurgeSelector(**kwargs)  # type: ignore[arg-type]


def test_compact_copy_is_smaller_and_whole(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s") as store:
        for tenant in ("a", "b"):
            fill(store, ident(tenant=tenant), size=200_000)
        store.purge(PurgeSelector(tenant="a"))
        report = store.compact_to(tmp_path / "copy")
        assert report["bytes_after"] < report["bytes_before"]
        # every tenant's bytes: the copy is its owner's alone
        assert (tmp_path / "copy").stat().st_mode & 0o777 == 0o700
        assert (tmp_path / "copy" / "data.mdb").stat().st_mode & 0o777 == 0o600
        with pytest.raises(Exception, match="not empty"):
            store.compact_to(tmp_path / "copy")
    with Store.open(tmp_path / "copy", create=False) as copy:
        assert copy.check() == [] and copy.stats().blocks == 5
        assert copy.load(ident(tenant="b"), PROMPT, bytearray(1 << 21)).n_blocks == 5


def test_share_groups_are_the_only_way_tenants_share(tmp_path: Path) -> None:
    with Store.open(tmp_path / "s", share_groups=("labs=a+b",)) as store:
        a, b, c = ident(tenant="a"), ident(tenant="b"), ident(tenant="c")
        fill(store, a)
        assert store.longest_prefix(b, PROMPT).n_blocks == 5  # configured: shared
        assert store.put(b, PROMPT, [b"x"] * 5).existed == 5
        assert store.longest_prefix(c, PROMPT).n_blocks == 0  # not in the group
        assert store.stats().blocks == 5
        assert store.load(b, PROMPT, bytearray(1000)).n_blocks == 5
        # the group's entries belong to the group, not to one member
        assert store.purge(PurgeSelector(tenant="a")).blocks == 0
        assert store.purge(PurgeSelector(tenant="share:labs")).blocks == 5
        with pytest.raises(IdentityError, match="reserved"):
            store.put(ident(tenant="share:labs"), PROMPT, [b"x"])


@pytest.mark.parametrize("entries", [("labs=a",), ("labs=a+b", "more=b+c"), ("=a+b",)])
def test_bad_share_groups(tmp_path: Path, entries: tuple[str, ...]) -> None:
    with pytest.raises(ConfigError, match="share_groups"):
        Store.open(tmp_path / "s", share_groups=entries)


def test_loads_during_a_purge_are_whole_or_miss(tmp_path: Path) -> None:
    """Reads that race a tenant purge return the old verified bytes or fewer blocks, never torn."""
    import threading

    prompts = [list(range(i * 100, i * 100 + 40)) for i in range(20)]  # ten blocks each
    expected = {i: [bytes([i, b]) * 500 for b in range(10)] for i in range(20)}
    with Store.open(tmp_path / "s") as store:
        for i, prompt in enumerate(prompts):
            store.put(ident(), prompt, expected[i])
        errors: list[str] = []
        stop = threading.Event()
        passes = [0, 0]  # whole passes over the prompts, per reader
        passed = threading.Condition()

        def reader(n: int) -> None:
            out = bytearray(10 * 1000)
            while not stop.is_set():
                for i, prompt in enumerate(prompts):
                    loaded = store.load(ident(), prompt, out)
                    for b, (offset, size) in enumerate(zip(loaded.offsets, loaded.sizes)):
                        if bytes(out[offset : offset + size]) != expected[i][b]:
                            errors.append(f"prompt {i} block {b} torn")
                with passed:
                    passes[n] += 1
                    passed.notify_all()

        def each_reader_passes(after: list[int]) -> None:
            with passed:
                assert passed.wait_for(lambda: all(p > a for p, a in zip(passes, after)), 60)

        threads = [threading.Thread(target=reader, args=(n,)) for n in range(2)]
        for thread in threads:
            thread.start()
        try:
            each_reader_passes([0, 0])  # both are reading (and go on) when the purge begins
            report = store.purge(PurgeSelector(tenant="a"))
            with passed:
                after = list(passes)
            each_reader_passes(after)  # and both read every prompt again once it is over
        finally:  # a failure is the test's, not readers' of a closed store
            stop.set()
            for thread in threads:
                thread.join()
        assert report.blocks == 200 and not errors
        assert all(store.load(ident(), p, bytearray(10_000)).n_blocks == 0 for p in prompts)


def test_a_failed_fsync_after_the_clearing_is_the_stores_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The clearing's own fsync failing is reported like any other: the purge raises, the store
    refuses writes and the marker tells the next start."""
    import errno

    from prefixd.errors import SyncFailedError
    from prefixd.store import scrub

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    with Store.open(tmp_path / "s") as store:
        fill(store, ident())
        monkeypatch.setattr(scrub.os, "fdatasync", failing)
        with pytest.raises(SyncFailedError, match="clearing"):
            store.purge(PurgeSelector(tenant="a"))
        monkeypatch.undo()
        assert store.sync_failure is not None
        with pytest.raises(SyncFailedError):
            fill(store, ident(tenant="b"))
    assert (tmp_path / "s" / "sync-failed.json").exists()


def test_a_big_write_after_the_purge_brings_nothing_back(tmp_path: Path) -> None:
    """LMDB reuses the memory of the pages one transaction dirtied without clearing it: after the
    victim's one big put, a big put of another tenant after the purge would write the victim's old
    pages into the unused parts of its own, had the clearing not overwritten that memory."""
    needles = Needles(seed=12)
    victim, other = ident(tenant=needles.name("deep-victim-90b2")), ident(tenant="b")
    with Store.open(tmp_path / "s", map_size=256 << 20) as store:
        store.put(victim, needles.tokens(victim, 1500), needles.payloads(1500, 3000))
        for _ in range(30):
            filler = needles.payloads(2, 3000, planted=False)
            store.put(other, needles.tokens(other, 2, planted=False), filler)
        store.purge(PurgeSelector(tenant=victim.tenant))
        assert needles.found(tmp_path / "s") == {}
        big = needles.payloads(1500, 2200, planted=False)  # each a page with 1.8 KB unused
        store.put(other, needles.tokens(other, 1500, planted=False), big)
        store.sync()
        assert needles.found(tmp_path / "s") == {}


def lmdb_free_pages_past_the_end(path: Path) -> lmdb.Environment:
    """An LMDB file whose free list names pages past its end: a transaction that takes new pages
    and frees them again (a value put and deleted) never writes them, yet frees them."""
    env = lmdb.open(str(path), map_size=1 << 24, max_dbs=2)
    table = env.open_db(b"t")
    for key in (b"a", b"b"):
        with env.begin(write=True) as txn:
            txn.put(key, b"x", db=table)
    with env.begin(write=True) as txn:
        txn.put(b"k", bytes(9000), db=table)  # three overflow pages, after the file's last
        txn.delete(b"k", db=table)
    return env


def free_pages(fd: int, psize: int) -> list[int]:
    """The pages on the free list of an LMDB file's newest snapshot, read as the clearing reads it."""
    from prefixd.store import scrub

    walk = scrub._Walk(fd, psize)
    meta = scrub._newest([walk.read(n * psize, psize) for n in (0, 1)])
    return [pgno for _, pages in walk.free_list(meta) for pgno in pages]


def test_the_clearing_walks_free_pages_lmdb_never_wrote(tmp_path: Path) -> None:
    """The walk over data.mdb reads the free pages no reader can see; one LMDB freed in the
    transaction that took it was never written, so it lies past the file's end: nothing to clear
    there (a purge racing loads, which makes LMDB take new pages, met one and failed)."""
    import os

    from prefixd.errors import CorruptStoreError
    from prefixd.store import scrub

    env = lmdb_free_pages_past_the_end(tmp_path)
    data = tmp_path / "data.mdb"
    fd = os.open(data, os.O_RDWR)
    try:
        psize = env.stat()["psize"]
        assert max(free_pages(fd, psize)) >= data.stat().st_size // psize  # the case
        with env.begin(write=True) as txn:
            assert scrub._Walk(fd, psize).run(float("inf"), txn.id() - 1)
        # a page the trees reach past the end is damage, named as such
        os.truncate(data, 2 * psize + 16)
        with env.begin(write=True) as txn, pytest.raises(CorruptStoreError, match="past the end"):
            scrub._Walk(fd, psize).run(float("inf"), txn.id() - 1)
    finally:
        os.close(fd)
        env.close()


SIZES = [10, 300, 2000, 4080, 9000]  # one page, or overflow pages


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.tuples(
            st.booleans(),  # a read begins before the transaction (LMDB then takes new pages)
            st.lists(  # key, size, whether the transaction deletes it again
                st.tuples(st.integers(0, 12), st.sampled_from(SIZES), st.booleans()),
                min_size=1,
                max_size=20,
            ),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_the_clearing_keeps_every_entry_and_clears_every_free_page(
    tmp_path: Path, history: list[tuple[bool, list[tuple[int, int, bool]]]]
) -> None:
    """Over any history of puts and deletes (reads held across some), the walk keeps every value
    whole and leaves every free page zero past its header."""
    import os
    import tempfile

    from prefixd.store import scrub

    with tempfile.TemporaryDirectory(dir=tmp_path) as directory:  # one an example
        env = lmdb.open(directory, map_size=1 << 24, max_dbs=2)
        table = env.open_db(b"t")
        values: dict[bytes, bytes] = {}
        readers = []
        for n, (read_first, ops) in enumerate(history):
            if read_first:
                readers.append(env.begin())
            with env.begin(write=True) as txn:
                for key, size, deleted in ops:
                    name = b"k%02d" % key
                    values[name] = bytes([n + 1, key]) * (size // 2)
                    txn.put(name, values[name], db=table)
                    if deleted:
                        txn.delete(name, db=table)
                        del values[name]
        for reader in readers:
            reader.abort()
        data = Path(directory) / "data.mdb"
        fd = os.open(data, os.O_RDWR)
        try:
            psize = env.stat()["psize"]
            with env.begin(write=True) as txn:
                assert scrub._Walk(fd, psize).run(scrub._oldest_reader(env), txn.id() - 1)
            for pgno in free_pages(fd, psize):
                page = os.pread(fd, psize, pgno * psize)
                assert page[scrub.PAGE_HEADER :].count(0) == len(page[scrub.PAGE_HEADER :])
        finally:
            os.close(fd)
        with env.begin() as txn:
            assert dict(txn.cursor(db=table)) == values
        env.close()
