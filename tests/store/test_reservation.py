"""LMDB's write map over space reserved ahead (prefixd.store.reservation): used where the file
system can reserve, never past what is reserved, a full disk an error before the write (the same
disk without the reservation kills the writer with SIGBUS), stores moving between the modes, a
file cut short refused, a flipped byte caught, and readers never shown a page a writer reuses."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.errors import CorruptStoreError
from prefixd.store.purge import PurgeSelector
from prefixd.store.reservation import file_system_of

from ..disks import tmpfs
from .test_faults import (
    BAD,
    IDENT,
    N_BLOCKS,
    TOKENS,
    corrupt_payload,
    corrupt_stored_chunk,
    open_store,
    put_chain,
)

REPO = str(Path(__file__).resolve().parents[2])


def ident(tenant: str = "a") -> Identity:
    return Identity(
        model="m",
        weights="w",
        tokenizer="t",
        template="c",
        rope="r",
        kv_layout="bf16",
        block_tokens=4,
        tenant=tenant,
    )


def prompt(i: int, blocks: int) -> list[int]:
    return [1_000_000 * (i + 1) + t for t in range(4 * blocks)]


def payloads(i: int, blocks: int, size: int) -> list[bytes]:
    rng = np.random.default_rng(i)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(blocks)]


def test_the_write_map_runs_where_the_file_system_reserves_and_says_so(tmp_path: Path) -> None:
    assert file_system_of(Path("/proc")) is None  # no reserving file system: pages are copied
    with tmpfs(tmp_path / "disk", "256m") as disk:
        assert file_system_of(disk) == "tmpfs"
        with Store.open(disk / "s") as store:
            stats = store.stats()
            assert stats.write_map == "tmpfs" and stats.reserved_bytes >= stats.map_used_bytes
        with Store.open(disk / "t", write_map=False) as store:
            assert (store.stats().write_map, store.stats().reserved_bytes) == ("", 0)


def test_no_transaction_reaches_past_the_reserved_space(tmp_path: Path) -> None:
    """Puts of every size, evictions, access times, purges and their clearing: after each, the
    file's last page is inside the reservation (a transaction's pages only grow up to its commit),
    and the reservation stays near what is used."""
    rng = random.Random(3)
    with (
        tmpfs(tmp_path / "disk", "512m") as disk,
        Store.open(disk / "s", map_size=256 << 20, capacity_bytes=96 << 20) as store,
    ):
        for step in range(120):
            op = rng.choice(("put", "put", "put", "purge", "sync"))
            if op == "put":
                blocks = rng.randint(1, 8)
                size = rng.choice((300, 5000, 70_000, 1 << 20, 3 << 20))
                tenant = rng.choice("abc")
                store.put(ident(tenant), prompt(step, blocks), payloads(step, blocks, size))
            elif op == "purge":
                store.purge(PurgeSelector(tenant=rng.choice("abc")))
            else:
                store.sync()
            stats = store.stats()
            assert stats.map_used_bytes <= stats.reserved_bytes, (step, op)
        assert stats.reserved_bytes <= 2 * stats.map_used_bytes + (16 << 20)
        assert store.check() == []


FILLER = textwrap.dedent(
    """
    import sys, os
    sys.path.insert(0, {repo!r})
    from tests.store.test_reservation import ident, prompt, payloads
    from prefixd import Store
    from prefixd.errors import DiskFullError
    from prefixd.store import reservation

    disk, write_map, reserve = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
    if not reserve:  # what the write map would do without the reservation
        reservation.Reservation._ensure = lambda self: None
    store = Store.open(disk + "/s", map_size=256 << 20, write_map=write_map)
    print("mode", store.stats().write_map or "off", flush=True)
    stored = []
    try:
        for i in range(200):
            store.put(ident(), prompt(i, 2), payloads(i, 2, 1 << 20))
            stored.append(i)
    except DiskFullError as exc:
        print("full", len(stored), flush=True)
    for i in stored:
        loaded = store.load(ident(), prompt(i, 2), bytearray(2 << 20))
        assert loaded.n_blocks == 2 and loaded.sizes == (1 << 20, 1 << 20), i
    assert store.check() == []
    os.unlink(disk + "/ballast")  # space comes back: so do puts
    store.put(ident(), prompt(999, 2), payloads(999, 2, 1 << 20))
    assert store.longest_prefix(ident(), prompt(999, 2)).n_blocks == 2
    store.close()
    print("recovered", flush=True)
    """
)


def _fill(disk: Path, *, write_map: bool, reserve: bool = True) -> subprocess.CompletedProcess[str]:
    (disk / "ballast").write_bytes(bytes(8 << 20))
    script = disk.parent / "filler.py"
    script.write_text(FILLER.format(repo=REPO))
    argv = [sys.executable, str(script), str(disk), str(int(write_map)), str(int(reserve))]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)


@pytest.mark.parametrize("write_map", [True, False], ids=["write-map", "copying"])
def test_a_full_disk_is_an_error_before_the_write_never_a_signal(
    tmp_path: Path, write_map: bool
) -> None:
    with tmpfs(tmp_path / "disk", "40m") as disk:
        done = _fill(disk, write_map=write_map)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split("\n")
    assert lines[0] == f"mode {'tmpfs' if write_map else 'off'}"
    assert lines[1].startswith("full ") and int(lines[1].split()[1]) > 0, done.stdout
    assert lines[2] == "recovered"


def test_without_the_reservation_the_full_disk_kills_the_writer(tmp_path: Path) -> None:
    """The hazard the reservation is there for: the write map alone dies of SIGBUS on this disk."""
    with tmpfs(tmp_path / "disk", "40m") as disk:
        done = _fill(disk, write_map=True, reserve=False)
    assert done.returncode == -signal.SIGBUS, (done.returncode, done.stdout, done.stderr)


def test_a_store_moves_between_the_modes_unchanged(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "256m") as disk:
        written: dict[int, list[bytes]] = {}
        for round_, write_map in enumerate((False, True, False, True)):
            with Store.open(disk / "s", map_size=128 << 20, write_map=write_map) as store:
                assert store.stats().write_map == ("tmpfs" if write_map else "")
                for i, expected in written.items():
                    out = bytearray(3 * 40_000)
                    loaded = store.load(ident(), prompt(i, 3), out)
                    assert bytes(out[: loaded.sizes[0] * 3]) == b"".join(expected), i
                for i in range(10 * round_, 10 * round_ + 10):
                    written[i] = payloads(i, 3, 40_000)
                    store.put(ident(), prompt(i, 3), written[i])
                assert store.check() == []


def test_a_file_cut_short_is_refused_before_the_write_map_extends_it(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", "256m") as disk:
        with Store.open(disk / "s", map_size=128 << 20) as store:
            for i in range(8):
                store.put(ident(), prompt(i, 2), payloads(i, 2, 200_000))
            used = store.stats().map_used_bytes
        data = disk / "s" / "data.mdb"
        assert data.stat().st_size == 128 << 20  # the write map's file is as long as the map
        os.truncate(data, used // 2)
        with pytest.raises(CorruptStoreError, match="cut short"):
            Store.open(disk / "s", map_size=128 << 20)
        assert data.stat().st_size == used // 2  # LMDB did not extend it over the damage


def test_readers_never_see_a_page_a_writer_reuses(tmp_path: Path) -> None:
    """Loads of a chain while a writer fills and evicts around it (freed pages reused in place):
    every load is the stored bytes, whole, and nothing is quarantined."""
    stop = threading.Event()
    errors: list[BaseException] = []
    with (
        tmpfs(tmp_path / "disk", "256m") as disk,
        Store.open(disk / "s", map_size=64 << 20, capacity_bytes=24 << 20) as store,
    ):
        keep = payloads(0, 4, 256 << 10)

        def read() -> None:
            try:
                while not stop.is_set():
                    out = bytearray(4 << 20)
                    loaded = store.load(ident(), prompt(0, 4), out)
                    n = loaded.n_blocks
                    got = [bytes(out[o : o + s]) for o, s in zip(loaded.offsets, loaded.sizes)]
                    assert got == keep[:n]
                    if n < 4:  # evicted meanwhile: store it again
                        store.put(ident(), prompt(0, 4), keep)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        store.put(ident(), prompt(0, 4), keep)
        readers = [threading.Thread(target=read) for _ in range(3)]
        for thread in readers:
            thread.start()
        try:
            for i in range(1, 120):
                store.put(ident("b"), prompt(i, 2), payloads(i, 2, 512 << 10))
        finally:
            stop.set()
            for thread in readers:
                thread.join()
        assert errors == []
        stats = store.stats()
        assert stats.quarantined == 0 and stats.verify_failures == 0
        assert store.check() == []


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_a_flipped_byte_under_the_write_map_is_a_miss_and_quarantined(
    tmp_path: Path, compression: str
) -> None:
    with tmpfs(tmp_path / "disk", "256m") as disk:
        path = disk / "s"
        payloads, hashes = put_chain(path, compression)
        if compression == "none":
            corrupt_payload(path, payloads[BAD])
        else:
            corrupt_stored_chunk(path, hashes[BAD])
        with open_store(path, compression=compression) as store:
            assert store.stats().write_map == "tmpfs"
            out = bytearray(sum(len(p) for p in payloads))
            assert store.load(IDENT, TOKENS, out).n_blocks == BAD
            assert store.stats().quarantined == 1 and store.check() == []
            store.put(IDENT, TOKENS, payloads[BAD:], first_block=BAD)
            assert store.load(IDENT, TOKENS, out).n_blocks == N_BLOCKS
