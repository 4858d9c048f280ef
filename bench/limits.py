"""The I/O path at the machine's limits: every row a ratio against its limit, measured in one run.

    python bench/limits.py [--quick | --full] [--only ROW,...] [--json]

| row          | measure                                       | limit, in the same run              |
|--------------|-----------------------------------------------|-------------------------------------|
| put_chain    | Store.put of one 16 KiB block extending a     | raw LMDB (py-lmdb, the store's map  |
|              | chain (first_block = k, k up to 2,000):       | settings), one write transaction    |
|              | blocks/s, and the slope of put time against k | per 16 KiB put: puts/s              |
| put_roots    | one 16 KiB block, a new root each put:        | raw LMDB, a transaction per put     |
|              | library, and through the daemon (Client.put); |                                     |
|              | library_put_us: a library put back to back    |                                     |
|              | and right after a 0.4 ms wait, as a daemon's  |                                     |
|              | loop waits between a client's puts            |                                     |
| put_64       | 64 blocks per put through the daemon          | raw LMDB, 64 puts in one txn        |
| first_load   | first load into a fresh client's region       | the second load into that region    |
|              | (512 MiB of 1 MiB blocks); the daemon's minor |                                     |
|              | page faults during each                       |                                     |
| durable_put  | 1 MiB puts, Store with durability full and    | a plain file: write + fsync per put |
|              | periodic                                      | (full), writes with an fsync every  |
|              |                                               | second (periodic)                   |
| lookup       | 131,072 tokens in 512-token blocks, blocking  | a blocking Unix-socket echo round   |
|              | client: p50/p99 us; and `hello`               | trip (an echo thread)               |
| lookup_scale | lookup p50/p99 at 1M stored entries           | the same at 1K entries              |
| load_clients | aggregate GB/s and p99 of 1, 4, 16 (32 with   | as many processes memcpy-ing the    |
|              | --full) processes loading the same blocks,    | same bytes between touched buffers  |
|              | each into its own region                      |                                     |
| cold_load    | a load by a fresh daemon, data.mdb in the     | readinto of a plain file in the     |
|              | page cache; and after the cache was emptied   | page cache; and cold                |

Each row reports `measure`, `limit`, `ratio` (measure / limit; for latencies, measure / limit too,
so lower is better there) and `targets`: the issue's bounds, each with the value checked and
`met`. Contender and limit alternate within every round, their order rotating, after an untimed
warm-up round, and each figure is the median of the rounds (bench/limits_puts.py,
bench/limits_loads.py and bench/limits_lookups.py say how each row is measured).

cold_load empties the page cache with /proc/sys/vm/drop_caches (root only) in the default and
--full modes, and where that is not permitted evicts just the two files it reads
(POSIX_FADV_DONTNEED) and says so; --quick always does the latter. It reports the largest
fraction of either file still in the page cache before a cold round (mincore), to show the round
was cold.

`row_reported_to_host_mib` says how much freed memory the VM's kernel handed back to its host
during each row (free page reporting to a virtio balloon; None where the kernel does not say):
the next writes into those pages wait for the host, which can halve a write row.

`--quick` runs every row with small sizes in seconds (tests/bench/test_limits.py runs it): its
figures are for shape, not for comparison. GB/s means 1e9 bytes per second. Everything lives in
temporary directories, removed at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import limits_loads
import limits_lookups
import limits_puts
import numpy as np
from benchlib import run_in_workdir
from limitlib import Preset, reported_to_host_kib
from suitelib import MiB, machine_info

from prefixd.store.allocator import keep_write_buffers

SEED = 20240610

Row = Callable[[Path, Preset, np.random.Generator], dict[str, Any]]
ROWS: dict[str, Row] = {
    "put_chain": limits_puts.put_chain,
    "put_roots": limits_puts.put_roots,
    "put_64": limits_puts.put_64,
    "first_load": limits_loads.first_load,
    "durable_put": limits_puts.durable_put,
    "lookup": limits_lookups.lookup,
    "lookup_scale": limits_lookups.lookup_scale,
    "load_clients": limits_loads.load_clients,
    "cold_load": limits_loads.cold_load,
}

DEFAULT = Preset(
    mode="default",
    repeat=5,
    chain_blocks=2000,
    root_puts=1000,
    put64_puts=64,
    first_load_bytes=512 * MiB,
    durable_full_puts=256,
    durable_periodic_puts=1024,
    lookups=2000,
    lookup_warmup=100,
    scale_entries=1_000_000,
    scale_lookups=2000,
    scale_warmup=200,
    clients=(1, 4, 16),
    client_bytes=32 * MiB,
    client_loads=4,
    cold_bytes=256 * MiB,
    drop_caches=True,
)
FULL = dataclasses.replace(DEFAULT, mode="full", clients=(1, 4, 16, 32))
QUICK = Preset(
    mode="quick",
    repeat=2,
    chain_blocks=120,
    root_puts=60,
    put64_puts=3,
    first_load_bytes=16 * MiB,
    durable_full_puts=4,
    durable_periodic_puts=16,
    lookups=60,
    lookup_warmup=10,
    scale_entries=5_000,
    scale_lookups=60,
    scale_warmup=10,
    clients=(1, 4),
    client_bytes=4 * MiB,
    client_loads=2,
    cold_bytes=8 * MiB,
    drop_caches=False,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    preset: Preset
    rows: tuple[str, ...]
    root: Path | None
    json: bool
    verbose: bool


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="small sizes, seconds in all")
    sizes.add_argument("--full", action="store_true", help="load_clients with 32 processes too")
    parser.add_argument("--only", default=",".join(ROWS), help="rows to run, comma-separated")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary data goes")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    rows = tuple(r for r in args.only.split(",") if r)
    unknown = sorted(set(rows) - set(ROWS))
    if unknown or not rows:
        parser.error(f"unknown rows: {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    preset = QUICK if args.quick else FULL if args.full else DEFAULT
    return Settings(preset, rows, args.dir, args.json, args.verbose)


def run(settings: Settings, workdir: Path, sock_dir: Path) -> dict[str, Any]:
    del sock_dir  # every daemon makes its own (suitelib.SuiteDaemon)
    loadavg = os.getloadavg()
    keep_write_buffers()  # as `prefixd serve` runs (prefixd.store.allocator)
    started = time.perf_counter()
    rows: dict[str, Any] = {}
    row_s: dict[str, float] = {}
    reported_mib: dict[str, int | None] = {}
    for index, name in enumerate(ROWS):
        if name not in settings.rows:
            continue
        began = time.perf_counter()
        before = reported_to_host_kib()
        root = workdir / name
        root.mkdir()
        rows[name] = ROWS[name](root, settings.preset, np.random.default_rng((SEED, index)))
        row_s[name] = round(time.perf_counter() - began, 1)
        after = reported_to_host_kib()
        reported_mib[name] = None if before is None or after is None else (after - before) >> 10
        if settings.verbose:
            print(f"{name} ({row_s[name]} s): {rows[name]}", file=sys.stderr, flush=True)
    return {
        "mode": settings.preset.mode,
        "rows": rows,
        "targets_missed": [
            f"{name}: {t['what']} {t['op']} {t['bound']} (got {t['value']})"
            for name, r in rows.items()
            for t in r["targets"]
            if not t["met"]
        ],
        "row_s": row_s,
        # freed memory the VM gave back to its host during each row (None: the kernel does not
        # say); writes into those pages wait for the host, which can halve a write row
        "row_reported_to_host_mib": reported_mib,
        "total_s": round(time.perf_counter() - started, 1),
        "settings": dataclasses.asdict(settings.preset),
        "machine": machine_info(loadavg),
    }


EXTRAS = (
    "slope_us_per_block",
    "daemon_minor_faults",
    "cold_method",
    "drop_caches_skipped",
    "resident_before_cold",
)


def _figures(values: dict[str, Any]) -> str:
    return "  ".join(f"{k} {v}" for k, v in values.items())


def print_table(report: dict[str, Any]) -> None:
    print(f"prefixd at the machine's limits ({report['mode']} mode, {report['total_s']} s)")
    for name, r in report["rows"].items():
        print(f"{name} [{r['unit']}]")
        for part in ("measure", "limit", "ratio"):
            print(f"  {part:<8} {_figures(r[part])}")
        for t in r["targets"]:
            verdict = "met" if t["met"] else "MISSED"
            print(f"  target   {t['what']} {t['op']} {t['bound']}: {t['value']} {verdict}")
        for key in EXTRAS:
            if r.get(key):
                print(f"  {key}: {r[key]}")
        reported = report["row_reported_to_host_mib"].get(name)
        if reported:
            print(f"  memory the VM reported to its host meanwhile: {reported} MiB")


def main(argv: Sequence[str] | None = None) -> int:
    return run_in_workdir(parse_args(argv), run, print_table, prefix="prefixd-limits-")


if __name__ == "__main__":
    raise SystemExit(main())
