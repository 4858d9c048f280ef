"""What the rows of bench/limits.py share: a row's shape (measure, limit, ratio, targets), the raw
LMDB environment the store's puts are held against, rotation, rates and a process's page faults."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import lmdb

from prefixd.store.syncer import PeriodicSyncer
from prefixd.store.tables import TABLE_NAMES

MAP_SIZE = 8 << 30


@dataclass(frozen=True)
class Target:
    """The issue's bound on one figure of a row: `what` names it ("ratio.daemon", "measure.p50_us"),
    `op` is ">=" or "<="."""

    what: str
    op: str
    bound: float


def row(
    unit: str,
    measure: dict[str, Any],
    limit: dict[str, Any],
    ratio: dict[str, Any],
    targets: Sequence[Target] = (),
    **details: Any,
) -> dict[str, Any]:
    """One row of the report; each target carries the value it was checked against and `met`."""
    figures = {"measure": measure, "limit": limit, "ratio": ratio}
    checked = []
    for target in targets:
        part, _, key = target.what.partition(".")
        value = figures[part].get(key)
        met = value is not None and (
            value >= target.bound if target.op == ">=" else value <= target.bound
        )
        checked.append(
            {
                "what": target.what,
                "op": target.op,
                "bound": target.bound,
                "value": value,
                "met": met,
            }
        )
    return {"unit": unit, **figures, "targets": checked, **details}


def ratio_of(a: float | None, b: float | None) -> float | None:
    """a / b rounded, or None where either was not measured."""
    if a is None or b is None or b <= 0:
        return None
    return round(a / b, 3)


def rotated(names: Sequence[str], turn: int) -> list[str]:
    """`names` started at position `turn`: whoever went first last time goes last this time."""
    shift = turn % len(names)
    return list(names[shift:]) + list(names[:shift])


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def per_second(count: int, seconds: float) -> float:
    return round(count / seconds, 1) if seconds > 0 else 0.0


def interleaved(
    actions: dict[str, Callable[[], Any]],
    repeat: int,
    *,
    warmup: int = 1,
    setup: dict[str, Callable[[], Any]] | None = None,
    teardown: dict[str, Callable[[], Any]] | None = None,
) -> dict[str, list[float]]:
    """Seconds of each action per round, the actions interleaved in a rotating order; the first
    `warmup` rounds are not kept. `setup[name]` runs before and `teardown[name]` after each
    timing of `name`, untimed (opening a fresh store, removing it)."""
    seconds: dict[str, list[float]] = {name: [] for name in actions}
    for round_ in range(warmup + repeat):
        for name in rotated(list(actions), round_):
            if setup and name in setup:
                setup[name]()
            gc.collect()
            started = time.perf_counter()
            actions[name]()
            elapsed = time.perf_counter() - started
            if teardown and name in teardown:
                teardown[name]()
            if round_ >= warmup:
                seconds[name].append(elapsed)
    return seconds


def minor_faults(pid: int) -> int:
    """The process's minor page faults so far (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return int(fields[7])  # field 10 of stat(5); `fields` starts at field 3


# KiB of free memory a guest kernel has handed back to its host so far (free page reporting to a
# virtio balloon); absent on bare metal and on kernels without it
REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def reported_to_host_kib() -> int | None:
    """How much freed memory this VM's kernel has reported to its host so far, or None where it
    does not say. Memory reported is taken back by the host, and the next write into those pages
    waits for the host to map them again: on the development VM a 1 MiB periodic put row ran at
    0.57 of its plain-file limit with 388 MiB reported during it, and at 0.86 with the reporting
    held back (min_free_ms=60000), in the same process state."""
    try:
        return int(REPORTED_KIB.read_text())
    except (OSError, ValueError):
        return None


def resident_fraction(path: Path) -> float:
    """The fraction of the file's pages in the page cache (mincore(2) on a mapping of it, which
    faults nothing in): shows that a cold read was cold."""
    size = path.stat().st_size
    if size == 0:
        return 0.0
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    vec = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        start = ctypes.c_char.from_buffer(mapped)  # a private mapping: nothing is written back
        failed = libc.mincore(ctypes.addressof(start), size, vec) != 0
        del start  # the mapping cannot close while a pointer into it is exported
    if failed:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) / pages


class RawLmdb:
    """py-lmdb used directly with the store's map settings (prefixd.store.environment: map size,
    table count, readahead, no writemap, sync and metasync only under `full`), and under
    `periodic` the store's own background syncer at the same interval: the floor a put is held
    against. One table; keys are 32-byte hashes like the store's."""

    def __init__(
        self,
        path: Path,
        *,
        durability: str = "periodic",
        sync_interval_s: float = 1.0,
        map_size: int = MAP_SIZE,
    ) -> None:
        full = durability == "full"
        path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(
            str(path),
            map_size=map_size,
            max_dbs=len(TABLE_NAMES),
            subdir=True,
            readahead=True,
            sync=full,
            metasync=full,
            writemap=False,
            mode=0o640,
        )
        self.db = self.env.open_db(b"blocks")
        self._syncer = None if full else PeriodicSyncer(self.sync, sync_interval_s)
        if self._syncer is not None:
            self._syncer.start()

    def put(self, key: bytes, value: Any) -> None:
        """One write transaction for one value."""
        with self.env.begin(write=True, db=self.db) as txn:
            txn.put(key, value)

    def put_many(self, items: Sequence[tuple[bytes, Any]]) -> None:
        """One write transaction for all of `items`."""
        with self.env.begin(write=True, db=self.db) as txn:
            for key, value in items:
                txn.put(key, value)

    def sync(self) -> None:
        self.env.sync(True)

    def close(self) -> None:
        if self._syncer is not None:
            self._syncer.stop()
        self.env.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class FileSyncer:
    """fsync of one file descriptor every `interval_s` seconds on a thread (prefixd's own
    PeriodicSyncer): the plain-file counterpart of the periodic durability mode."""

    def __init__(self, fd: int, interval_s: float) -> None:
        self._syncer = PeriodicSyncer(lambda: os.fsync(fd), interval_s)

    def __enter__(self) -> Self:
        self._syncer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._syncer.stop()


__all__ = [
    "MAP_SIZE",
    "FileSyncer",
    "Preset",
    "RawLmdb",
    "Target",
    "interleaved",
    "median",
    "minor_faults",
    "per_second",
    "ratio_of",
    "rotated",
    "row",
]


@dataclass(frozen=True)
class Preset:
    """The sizes of one mode of bench/limits.py."""

    mode: str
    repeat: int  # timed rounds of every row (after an untimed warm-up round)
    chain_blocks: int  # put_chain: the chain grows to this many 16 KiB blocks
    root_puts: int  # put_roots: puts per contender per round
    put64_puts: int  # put_64: 64-block puts per contender per round
    first_load_bytes: int  # first_load: bytes of 1 MiB blocks loaded
    durable_full_puts: int  # durable_put: 1 MiB puts per round under `full`
    durable_periodic_puts: int  # ... and under `periodic`
    lookups: int  # lookup: timed lookups (and hellos and echoes)
    lookup_warmup: int
    scale_entries: int  # lookup_scale: the large store's entries
    scale_lookups: int
    scale_warmup: int
    clients: tuple[int, ...]  # load_clients: process counts
    client_bytes: int  # bytes each process loads per load
    client_loads: int  # loads per process per round
    cold_bytes: int  # cold_load: bytes loaded cold
    drop_caches: bool  # cold_load: empty the whole page cache (else evict the two files only)
