"""A failed fsync is never forgotten: after one the store refuses writes (reads go on), never
syncs again as if it could succeed, records the failure in a marker, and its next open checks the
blocks written since the last good sync.

The failure is injected where the fault tests inject theirs: the store context's `env` is swapped
for one whose `sync` fails as a disk's would (LMDB's error, as it comes).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pytest

from prefixd import Store
from prefixd.clock import ManualClock
from prefixd.errors import StoreWriteError, SyncFailedError
from prefixd.schema.state import StateGroup
from prefixd.store import store as store_module
from prefixd.store.purge import PurgeSelector
from prefixd.store.recheck import RECHECK_SLACK_NS
from prefixd.store.sync_state import SYNC_MARKER, read_marker

from ..waiting import DEADLINE_S, wait_for
from .test_faults import IDENT, N_BLOCKS, TOKENS, corrupt_payload, open_store, random_payloads

OTHER_TOKENS = [0x5B5B0000 + i for i in range(N_BLOCKS * 4)]


class FailingSyncEnv:
    """A store's environment whose fsync fails with EIO, as LMDB reports it; everything else is
    the real environment's."""

    def __init__(self, env: lmdb.Environment) -> None:
        self._env = env
        self.syncs = 0

    def sync(self, force: bool = False) -> None:
        self.syncs += 1
        raise lmdb.DiskError("mdb_env_sync: Input/output error")

    def __getattr__(self, name: str) -> object:
        return getattr(self._env, name)


def fail_syncs(store: Store) -> FailingSyncEnv:
    failing = FailingSyncEnv(store._ctx.env)
    store._ctx.env = failing
    return failing


def assert_loads(store: Store, tokens: list[int], payloads: list[bytes]) -> None:
    out = bytearray(sum(map(len, payloads)))
    loaded = store.load(IDENT, tokens, out)
    assert loaded.n_blocks == len(payloads)
    for offset, size, expected in zip(loaded.offsets, loaded.sizes, payloads, strict=True):
        assert bytes(out[offset : offset + size]) == expected


@pytest.mark.parametrize("durability", ["periodic", "full"])
@pytest.mark.parametrize("found_by", ["sync", "periodic syncer", "warm-up ranking"])
def test_a_failed_sync_refuses_writes_keeps_reads_and_is_never_retried(
    tmp_path: Path, durability: str, found_by: str
) -> None:
    payloads = random_payloads(N_BLOCKS, size=1000)
    interval = 0.01 if found_by == "periodic syncer" else 3600.0
    store = open_store(tmp_path / "s", durability=durability, sync_interval_s=interval)
    try:
        store.put(IDENT, TOKENS, payloads)
        good_ns = store.last_sync_ns
        assert good_ns > 0 and store.sync_failure is None  # the open synced
        failing = fail_syncs(store)

        if found_by == "sync":
            with pytest.raises(SyncFailedError):
                store.sync()
        elif found_by == "periodic syncer":
            # the thread refuses writes first, then writes the marker
            wait_for(lambda: read_marker(store.path) is not None, "the syncer to record it")
        else:
            store.hottest(1 << 20, tenant="a")  # a read: its sync fails, the read goes on

        failure = store.sync_failure
        assert failure is not None and "Input/output error" in failure.error
        assert failure.last_good_ns >= good_ns
        assert read_marker(store.path) == failure  # written down, for the next open

        # every write is refused with the new error, which is a write error too
        writes = {
            "put": lambda: store.put(IDENT, OTHER_TOKENS, payloads),
            "delete": lambda: store.delete([store.chain_of(IDENT, TOKENS)[0]]),
            "purge": lambda: store.purge(PurgeSelector(tenant="a")),
            "evict": lambda: store.evict(0),
            "repair": store.repair,
        }
        for name, write in writes.items():
            with pytest.raises(SyncFailedError) as refused:
                write()
            assert isinstance(refused.value, StoreWriteError), name
            assert refused.value.code == "sync_failed"
            assert "refuses writes" in str(refused.value) and "restart" in str(refused.value)
        assert store.purge(PurgeSelector(tenant="a"), dry_run=True).blocks == N_BLOCKS

        # reads go on, and nothing was written
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == N_BLOCKS
        assert_loads(store, TOKENS, payloads)
        assert store.longest_prefix(IDENT, OTHER_TOKENS).n_blocks == 0
        assert store.stats().blocks == N_BLOCKS

        # never retried as if it could succeed: the disk answering again changes nothing
        store._ctx.env = failing._env
        tried = failing.syncs
        with pytest.raises(SyncFailedError):
            store.sync()
        assert failing.syncs == tried
        with pytest.raises(SyncFailedError):
            store.put(IDENT, OTHER_TOKENS, payloads)
        assert store.sync_failure == failure
    finally:
        store.close()  # no error: the failure was reported already
    assert read_marker(tmp_path / "s") == failure


def test_a_close_whose_fsync_fails_raises_and_leaves_the_marker(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", sync_interval_s=3600.0)
    store.put(IDENT, TOKENS, random_payloads(N_BLOCKS, size=1000))
    fail_syncs(store)
    with pytest.raises(SyncFailedError):
        store.close()
    with pytest.raises(Exception, match="closed"):
        store.longest_prefix(IDENT, TOKENS)
    marker = read_marker(tmp_path / "s")
    assert marker is not None and marker.last_good_ns > 0


def test_the_next_open_checks_the_blocks_written_since_the_last_good_sync(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "s"
    clock = ManualClock()
    old = random_payloads(N_BLOCKS, size=16 << 10, seed=1)
    new = random_payloads(N_BLOCKS, size=16 << 10, seed=2)
    with open_store(path, clock=clock, sync_interval_s=3600.0) as store:
        store.put(IDENT, TOKENS, old)
        clock.advance(2 * RECHECK_SLACK_NS / 1e9)  # older than the slack before the sync
        store.sync()  # the last good sync: the old chain is on disk
        clock.advance(1)
        new_hashes = store.put(IDENT, OTHER_TOKENS, new).hashes
        fail_syncs(store)
        with pytest.raises(SyncFailedError):
            store.sync()
        failed_at = store.sync_failure
    assert failed_at is not None
    # what the disk lost: a block written since the last good sync, and (found later, by a
    # read, not by this check) one written before it
    corrupt_payload(path, new[2])
    corrupt_payload(path, old[2])

    with caplog.at_level(logging.WARNING, logger="prefixd.store.recheck"):
        store = open_store(path, clock=clock)
    try:
        report = store.rechecked
        assert report is not None and report.complete
        assert report.since_ns == failed_at.last_good_ns - RECHECK_SLACK_NS
        assert (report.blocks, report.parts) == (N_BLOCKS, 0)  # the new chain only
        assert report.condemned == {new_hashes[2]: "payload fails verification"}
        assert report.quarantined == 2  # the block and the one below it
        assert "checked the 4 block(s) and 0 part(s)" in caplog.text
        assert "1 failed (1 payload fails verification)" in caplog.text

        # the state is cleared: the marker is gone and writes are taken again
        assert not (path / SYNC_MARKER).exists()
        assert store.sync_failure is None and store.last_sync_ns >= clock.time_ns()
        assert store.longest_prefix(IDENT, OTHER_TOKENS).n_blocks == 2
        assert store.stats().quarantined == 1
        assert store.put(IDENT, OTHER_TOKENS, new[2:], first_block=2).stored == 2
        assert_loads(store, OTHER_TOKENS, new)

        # the old chain was not checked: its damage is a read's to find, as always
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == N_BLOCKS
        out = bytearray(sum(map(len, old)))
        assert store.load(IDENT, TOKENS, out).n_blocks == 2
        assert store.check() == []
    finally:
        store.close()

    with open_store(path, clock=clock) as store:
        assert store.rechecked is None  # checked once: the next open has nothing to check


def test_an_unreadable_marker_makes_the_next_open_check_every_block(tmp_path: Path) -> None:
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put(IDENT, TOKENS, random_payloads(N_BLOCKS, size=1000))
    (path / SYNC_MARKER).write_bytes(b"\x00not json")
    with open_store(path) as store:
        report = store.rechecked
        assert report is not None and report.since_ns == 0 and report.blocks == N_BLOCKS
        assert report.condemned == {} and store.sync_failure is None
    assert not (path / SYNC_MARKER).exists()


def test_a_store_whose_first_sync_fails_opens_refusing_writes_and_is_checked_whole_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "s"
    with open_store(path) as store:
        store.put(IDENT, TOKENS, random_payloads(N_BLOCKS, size=1000))
    opened = store_module.open_environment

    def open_failing(*args: Any, **kwargs: Any) -> Any:
        env, tables, meta = opened(*args, **kwargs)
        return FailingSyncEnv(env), tables, meta

    monkeypatch.setattr(store_module, "open_environment", open_failing)
    with open_store(path) as store:  # the open's own sync fails: no good sync is known
        failure = store.sync_failure
        assert failure is not None and failure.last_good_ns == 0 and store.last_sync_ns == 0
        assert "no good sync is known" in failure.describe()
        assert store.longest_prefix(IDENT, TOKENS).n_blocks == N_BLOCKS
        with pytest.raises(SyncFailedError):
            store.put(IDENT, OTHER_TOKENS, random_payloads(N_BLOCKS, size=1000))
    monkeypatch.undo()
    with open_store(path) as store:  # so every block is checked
        report = store.rechecked
        assert report is not None and (report.since_ns, report.blocks) == (0, N_BLOCKS)
        assert store.sync_failure is None


def test_a_load_after_a_failed_fsync_quarantines_nothing(tmp_path: Path) -> None:
    """The store writes nothing more once an fsync failed: a damaged block a load meets is left
    where it is (it fails verification on every read, so it is never served)."""
    path = tmp_path / "s"
    payloads = random_payloads(N_BLOCKS)
    with open_store(path) as store:
        store.put(IDENT, TOKENS, payloads)
    corrupt_payload(path, payloads[2])
    with open_store(path, sync_interval_s=3600.0) as store:
        fail_syncs(store)
        with pytest.raises(SyncFailedError):
            store.sync()
        txn = store._ctx.env.info()["last_txnid"]
        loaded = store.load(IDENT, TOKENS, bytearray(sum(map(len, payloads))))
        assert loaded.n_blocks == 2
        assert store._ctx.env.info()["last_txnid"] == txn
        assert (store.stats().blocks, store.stats().quarantined) == (N_BLOCKS, 0)


def test_a_state_load_after_a_failed_fsync_meeting_a_damaged_part_is_a_miss(
    tmp_path: Path,
) -> None:
    """A hybrid load retries once what it met damaged is quarantined; with writes refused it
    stays, so the load answers a miss at once instead of retrying for ever."""
    ident = dataclasses.replace(IDENT, state=(StateGroup.paged("kv"), StateGroup.checkpoint("ssm")))
    tokens = np.arange(2 * ident.block_tokens, dtype=np.uint32)
    path = tmp_path / "s"
    with open_store(path) as store:
        pages = random_payloads(2)
        boundary = {2 * ident.block_tokens: b"s" * 64}
        store.put_state(ident, tokens, paged={"kv": pages}, checkpoints={"ssm": boundary})
    corrupt_payload(path, pages[1])
    with open_store(path, sync_interval_s=3600.0) as store:
        fail_syncs(store)
        with pytest.raises(SyncFailedError):
            store.sync()
        done: list[Any] = []
        reader = threading.Thread(
            target=lambda: done.append(store.load_state(ident, tokens, bytearray(1 << 16))),
            daemon=True,  # on a store that retries for ever, left behind
        )
        reader.start()
        reader.join(DEADLINE_S)
        assert done and done[0].match.reusable_tokens == 0


def test_a_put_waiting_to_commit_when_an_fsync_fails_is_refused(tmp_path: Path) -> None:
    """A put that was let in before the fsync failed, and commits after (it waited for its turn
    behind another commit), is refused, never acknowledged: nothing written then would stay."""
    store = open_store(tmp_path / "s", sync_interval_s=3600.0)
    commits = store._writer._commits
    outcome: list[object] = []

    def put() -> None:
        try:
            outcome.append(store.put(IDENT, OTHER_TOKENS, random_payloads(N_BLOCKS)))
        except SyncFailedError as exc:
            outcome.append(exc)

    try:
        with commits.held():  # another commit holds the turn
            putting = threading.Thread(target=put)
            putting.start()
            wait_for(lambda: commits.waiting == 1, "the put waits for its turn", poll_s=0.001)
            fail_syncs(store)
            with pytest.raises(SyncFailedError):
                store.sync()
        putting.join(10)
        assert isinstance(outcome[0], SyncFailedError), outcome
        assert store.longest_prefix(IDENT, OTHER_TOKENS).n_blocks == 0
    finally:
        store.close()


def test_the_eviction_a_put_sets_off_writes_nothing_once_its_fsync_failed(
    tmp_path: Path,
) -> None:
    """A put past the capacity evicts, and the eviction first writes the read times down with an
    fsync. That fsync failing, the eviction writes nothing (the store writes nothing after a
    failed fsync); the put itself, committed before, stays acknowledged."""
    store = open_store(tmp_path / "s", capacity_bytes=100_000, sync_interval_s=3600.0)
    try:
        for i in range(4):  # 80 KB of the 95 KB high watermark
            store.put(IDENT, [0x3C000000 + i * 100 + k for k in range(4)], [bytes([i]) * 20_000])
        fail_syncs(store)
        past = [0x3D000000 + k for k in range(4)]
        assert store.put(IDENT, past, [b"x" * 20_000]).stored == 1
        assert store.sync_failure is not None
        assert store.stats().blocks == 5  # nothing evicted
        assert store.longest_prefix(IDENT, past).n_blocks == 1
    finally:
        store.close()
