"""The write-behind (prefixd.store.write_behind): under `periodic` durability, once enough has been
committed, the kernel is asked to start writing data.mdb's dirty pages while puts go on; under
`full`, all along a large commit (small ones are left alone); never a failure of the put."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest

from prefixd import Store
from prefixd.store import write_behind
from prefixd.store.write_behind import SYNC_FILE_RANGE_WRITE, WriteBehind

from ..waiting import wait_for
from .test_faults import IDENT, random_payloads

BT = IDENT.block_tokens


class Calls:
    """Stands for libc: records each sync_file_range, answers `result`."""

    def __init__(self, result: int = 0) -> None:
        self.result = result
        self.made: list[tuple[str, int, int, int]] = []

    def sync_file_range(self, fd: int, offset: Any, nbytes: Any, flags: int) -> int:
        self.made.append((os.readlink(f"/proc/self/fd/{fd}"), offset.value, nbytes.value, flags))
        return self.result


def prompt(i: int, blocks: int) -> list[int]:
    return [7_000_000 * (i + 1) + t for t in range(BT * blocks)]


def test_puts_past_the_threshold_start_the_file_s_writeback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_behind, "KICK_BYTES", 256 << 10)
    calls = Calls()
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        behind = store._ctx.write_behind
        assert behind is not None
        behind._libc = calls
        store.put(IDENT, prompt(0, 2), random_payloads(2, size=64 << 10))  # 128 KiB: not yet
        assert behind.kicks == 0 and calls.made == []
        store.put(IDENT, prompt(1, 3), random_payloads(3, size=64 << 10, seed=2))  # 320 KiB
        wait_for(lambda: behind.kicks == 1, "the writeback started")
        store.put(IDENT, prompt(1, 3), random_payloads(3, size=64 << 10, seed=2))  # stored: 0
        assert behind.kicks == 1
    # the whole of data.mdb, written out without waiting
    assert calls.made == [(str(tmp_path / "s" / "data.mdb"), 0, 0, SYNC_FILE_RANGE_WRITE)]


def test_the_kernel_takes_the_request(tmp_path: Path) -> None:
    path = tmp_path / "data.mdb"
    path.write_bytes(os.urandom(4 << 20))  # dirty pages in the page cache
    behind = WriteBehind(path, full=False, kick_bytes=1 << 20)
    try:
        behind.committed(1 << 20)
        wait_for(lambda: behind.kicks == 1, "the writeback started")
    finally:
        behind.close()
    behind.close()  # idempotent


def test_a_refused_request_is_logged_and_puts_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(write_behind, "KICK_BYTES", 1)
    caplog.set_level(logging.DEBUG, logger="prefixd.store.write_behind")
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        behind = store._ctx.write_behind
        assert behind is not None
        behind._libc = Calls(result=-1)
        payloads = random_payloads(2, size=16 << 10)
        store.put(IDENT, prompt(0, 2), payloads)
        wait_for(lambda: behind.kicks == 1, "the writeback was asked for")
        store.put(IDENT, prompt(1, 2), payloads)
        wait_for(lambda: behind.kicks == 2, "the writeback was asked for again")
        assert store.longest_prefix(IDENT, prompt(1, 2)).n_blocks == 2
    # said once, loudly, with what to allow; later refusals only at debug level
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "@sync" in warned[0].getMessage()


def test_under_full_durability_a_large_commit_is_written_as_it_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(write_behind, "KICK_BYTES", 256 << 10)
    calls = Calls()
    with Store.open(tmp_path / "s", map_size=64 << 20, durability="full") as store:
        behind = store._ctx.write_behind
        assert behind is not None
        behind._libc = calls
        for i in range(4):  # small commits, however many: none
            store.put(IDENT, prompt(i, 1), random_payloads(1, size=64 << 10, seed=i))
        assert behind.kicks == 0
        store.put(IDENT, prompt(9, 5), random_payloads(5, size=64 << 10, seed=9))  # 320 KiB
        wait_for(lambda: behind.kicks >= 1, "the commit's pages were sent")
        assert store.longest_prefix(IDENT, prompt(9, 5)).n_blocks == 5
    assert {call[3] for call in calls.made} == {SYNC_FILE_RANGE_WRITE}
