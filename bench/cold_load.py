"""Loads from a store this process has not mapped yet, next to a plain read of the same bytes.

A daemon that starts (or restarts) on a machine whose page cache holds data.mdb, or on one whose
cache was dropped, serves its first loads from pages it has never mapped. Copying out of LMDB's
map then costs page faults (minor ones on a warm cache, each a small synchronous read on a cold
one); reading the chunks with preadv straight into the destination (StoreConfig.read_path,
prefixd.store.direct) does not. What it measures, in one run, interleaved and repeated:

* readinto:        `readinto` of the payloads' bytes (the file range their chunks occupy, one
                   call) from the page cache into a touched buffer: the ceiling of a warm load.
* load_<path>:     `Store.load` of the whole chain, verified, into a touched buffer, by a Store
                   opened afresh (its map holds no page yet) with read_path <path> (auto, mmap,
                   pread); data.mdb is in the page cache.
* mapped_<path>:   the same load again on that Store: its map already holds the pages (what
                   decides the auto rule: is the map faster once it is populated?).
* cold_readinto:   readinto of the same bytes right after data.mdb's pages were dropped.
* cold_<path>:     a fresh Store's load right after data.mdb's pages were dropped.

The pages are dropped with posix_fadvise(DONTNEED) after an fsync (this file only; `--drop
drop_caches` writes 3 to /proc/sys/vm/drop_caches instead, which needs root and empties every
cache of the machine); the fraction still resident (mincore) is reported. Ratios:
`load_vs_readinto` (auto, warm) target >= 0.8; `cold_vs_readinto` (auto, cold) target >= 0.9.
Every load is compared with the payloads (outside the timing). GB/s is 1e9 bytes per second.

    python bench/cold_load.py --json
    python bench/cold_load.py --size-mib 256 --repeat 5 -v
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import Samples, bench_identity, gbps, same_bytes, split, timed, touched_buffer

from prefixd import Store

MiB = 1 << 20
PATHS = ("auto", "mmap", "pread")
BLOCK_TOKENS = 256
TARGET_WARM = 0.8
TARGET_COLD = 0.9


def resident_fraction(path: Path) -> float:
    """How much of the file is in the page cache (mincore over a fresh map of it)."""
    size = path.stat().st_size
    libc = ctypes.CDLL(None, use_errno=True)
    with path.open("rb") as file, mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ) as mapped:
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * pages)()
        base = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
        if libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        resident = sum(v & 1 for v in vec)
    return resident / pages


def drop(path: Path, how: str) -> float:
    """Drop the file's cached pages; return the fraction still resident."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if how == "fadvise":
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    if how == "drop_caches":
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return resident_fraction(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--size-mib", type=int, default=512, help="payload bytes loaded")
    parser.add_argument("--block-kib", type=int, default=1024, help="per block")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions")
    parser.add_argument("--drop", choices=("fadvise", "drop_caches"), default="fadvise")
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary store goes")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    size = args.block_kib * 1024
    total = args.size_mib * MiB
    n_blocks = total // size

    def log(message: str) -> None:
        if args.verbose:
            print(message, file=sys.stderr, flush=True)

    workdir = Path(tempfile.mkdtemp(prefix="prefixd-cold-", dir=args.dir))
    try:
        rng = np.random.default_rng(20240611)
        source = rng.integers(0, 256, total, dtype=np.uint8)
        payloads = split(source, size)
        tokens = np.arange(n_blocks * BLOCK_TOKENS, dtype=np.uint32)
        ident = bench_identity(BLOCK_TOKENS, size)
        path = workdir / "store"
        settings: dict[str, Any] = {"map_size": 2 * total + (256 * MiB), "verify_threads": 2}
        with Store.open(path, **settings) as store:
            for first in range(0, n_blocks, 64):
                end = min(first + 64, n_blocks)
                store.put(
                    ident, tokens[: end * BLOCK_TOKENS], payloads[first:end], first_block=first
                )
        data = path / "data.mdb"
        start, length = payload_range(path, settings, ident, tokens, size)
        log(f"{n_blocks} blocks stored; their chunks span {length / MiB:.1f} MiB of data.mdb")
        dest = touched_buffer(total)
        span = touched_buffer(length)
        samples = Samples()
        residency: list[float] = []

        def readinto() -> None:
            with data.open("rb", buffering=0) as file:
                file.seek(start)
                if file.readinto(memoryview(span)) != length:
                    raise RuntimeError("short read")

        def fresh_load(read_path: str, mapped: bool) -> Callable[[], Any]:
            def run() -> float:
                with Store.open(path, **settings, read_path=read_path) as store:
                    if mapped:
                        store.load(ident, tokens, dest)
                    seconds, result = timed(lambda: store.load(ident, tokens, dest))
                    if result.n_blocks != n_blocks or not same_bytes(dest, source):
                        raise RuntimeError(f"a load ({read_path}) did not reproduce the payloads")
                dest.fill(0)
                return seconds

            return run

        for round_ in range(args.repeat + 1):
            for name in ("readinto", "cold_readinto"):
                if name.startswith("cold"):
                    residency.append(drop(data, args.drop))
                else:
                    readinto()  # back in the page cache
                seconds, _ = timed(readinto)
                if round_:
                    samples.add(name, seconds)
            for read_path in PATHS:
                for kind in ("load", "mapped", "cold"):
                    if kind == "cold":
                        residency.append(drop(data, args.drop))
                    else:
                        readinto()
                    seconds = fresh_load(read_path, kind == "mapped")()
                    if round_:
                        samples.add(f"{kind}_{read_path}", seconds)
            if round_:
                times = "  ".join(f"{k} {v[-1]:.3f}s" for k, v in samples.seconds.items())
                log(f"round {round_}: {times}")
        rate = {k: gbps(total, samples.median(k)) for k in samples.seconds}
        rate["readinto"] = gbps(length, samples.median("readinto"))
        rate["cold_readinto"] = gbps(length, samples.median("cold_readinto"))
        warm = rate["load_auto"] / rate["readinto"]
        cold = rate["cold_auto"] / rate["cold_readinto"]
        report = {
            "gbps": {k: round(v, 3) for k, v in rate.items()},
            "load_vs_readinto": round(warm, 3),
            "cold_vs_readinto": round(cold, 3),
            "per_path": {
                p: {
                    "load_vs_readinto": round(rate[f"load_{p}"] / rate["readinto"], 3),
                    "cold_vs_readinto": round(rate[f"cold_{p}"] / rate["cold_readinto"], 3),
                    "mapped_vs_readinto": round(rate[f"mapped_{p}"] / rate["readinto"], 3),
                }
                for p in PATHS
            },
            "targets": {"load_vs_readinto": TARGET_WARM, "cold_vs_readinto": TARGET_COLD},
            "meets_targets": {
                "load_vs_readinto": warm >= TARGET_WARM,
                "cold_vs_readinto": cold >= TARGET_COLD,
            },
            "resident_after_drop_max": round(max(residency), 4),
            "settings": {
                "size_mib": args.size_mib,
                "block_kib": args.block_kib,
                "repeat": args.repeat,
                "drop": args.drop,
                "span_bytes": length,
            },
            "seconds": {k: [round(s, 4) for s in v] for k, v in samples.seconds.items()},
            "machine": {"cpus": os.cpu_count(), "loadavg": os.getloadavg()},
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, value in report["gbps"].items():
            print(f"  {name:<16}{value:>8.2f} GB/s")
        for key in ("load_vs_readinto", "cold_vs_readinto"):
            met = "met" if report["meets_targets"][key] else "MISSED"
            print(f"  {key:<18}{report[key]:>6.2f}  (target {report['targets'][key]}: {met})")
        print(f"  resident after a drop, at most {report['resident_after_drop_max']:.2%}")
    return 0


def payload_range(
    path: Path, settings: dict[str, Any], ident: Any, tokens: np.ndarray, size: int
) -> tuple[int, int]:
    """The file range [start, start + length) the stored chunks occupy (found through the
    store's own DataFile, as a load finds them)."""
    from prefixd.schema.records import BlockRecord, chunk_key

    with Store.open(path, **settings, read_path="pread") as store:
        ctx = store._ctx
        data_file = ctx.data_file
        assert data_file is not None
        match = store.longest_prefix(ident, tokens)
        ends: list[tuple[int, int]] = []
        with ctx.env.begin(buffers=True) as txn:
            for h in match.hashes:
                record = BlockRecord.decode(txn.get(h, db=ctx.tables.blocks))
                chunks = [
                    txn.get(chunk_key(h, n), db=ctx.tables.chunks) for n in range(record.n_chunks)
                ]
                spans = data_file.spans(record, chunks)
                assert spans is not None
                ends.extend((at, at + c.nbytes) for at, c in zip(spans.offsets, chunks))
    start = min(a for a, _ in ends)
    return start, max(b for _, b in ends) - start


if __name__ == "__main__":
    raise SystemExit(main())
