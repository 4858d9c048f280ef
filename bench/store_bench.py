"""Throughput of the prefixd store against the hardware it runs on.

What it measures, in one run on one machine:

* put:        publish `--size-mib` of payloads through `Store.put` into a fresh store, the way an
              engine publishes a prompt (runs of `--run-blocks` blocks per call, each call extending
              the chain with `first_block`), then `Store.sync()` (fsync). Timed end to end.
* file_write: the same bytes written to one fresh plain file in the same directory in
              payload-sized `write` calls, then `fsync`. The floor the put is compared with.
* lmdb:       the same bytes put into a bare LMDB environment (py-lmdb, one value per payload, a
              transaction per run, the store's sync flags, then one fsync), in both of LMDB's
              map modes: pages copied into the page cache at commit (`lmdb_copying`, the store's)
              and the write map over a file allocated ahead (`lmdb_write_map`). What LMDB itself
              costs, and whether the other mode would pay on this machine.
* get:        a warm, verified read of every block into a preallocated, already-touched buffer, both
              through `Store.load` (lookup + read in one call) and `Store.longest_prefix` +
              `Store.read_into`; the better of the two is `get_gbps`. Checksums are verified in
              both, as they are in production.
* memcpy:     `numpy.copyto` of the same bytes between the same kind of buffers, in one call. The
              ceiling the get is compared with: a warm get cannot beat one copy of its bytes.
              `memcpy_block` is the same copy in payload-sized pieces, as the store copies; for
              context, since glibc switches to non-temporal stores only for copies above a
              cache-size-dependent threshold (about 99 MiB on a 2-core VM with a 260 MiB L3), so
              the two can differ by 1.6x on one machine.
* file_read:  payload-sized `readinto` of the plain file (warm, from the page cache) into the same
              destination buffer, for context.

Why: a store that is much slower than one copy (reads) or one plain write+fsync (writes) costs the
engine more than recomputing short prefixes would, so the ratios `get_vs_memcpy` (>= 0.6),
`put_vs_file_write` (>= 0.9 periodic, >= 0.8 full) and `put_vs_lmdb` (>= 0.8, against the faster
map mode) are what the project targets. GB/s means 1e9 bytes per second.

Every measure is the median of `--repeat` timed repetitions after one untimed warm-up. memcpy, get
and file_read are interleaved within each repetition (and so are the writes, each round in another
order) so that machine noise falls on all of them alike; the write ratios are taken round by round
and reported as their median and spread (`ratios`). The payloads are bf16 values of a normal distribution (like a KV
cache; `--data random` gives incompressible bytes instead) generated once into one array whose
slices are the payloads. The data directory is a temporary directory under /tmp unless `--dir` is
given, and is removed at the end.

    python bench/store_bench.py --json
    python bench/store_bench.py --compression zstd-planes --size-mib 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from benchlib import (
    Samples,
    bench_identity,
    gbps,
    removed,
    same_bytes,
    split,
    timed,
    touched_buffer,
)

from prefixd import Identity, Store
from prefixd.store.allocator import keep_write_buffers

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_SIZE_MIB = 1024
DEFAULT_PAYLOAD_KIB = 1024
DEFAULT_REPEAT = 5
DEFAULT_RUN_BLOCKS = 64
DEFAULT_LOOKUP_REPEAT = 20
BLOCK_TOKENS = 256
VOCAB = 128_000
SEED = 20240601
GEN_CHUNK_BYTES = 64 * MiB
TARGET_GET_VS_MEMCPY = 0.6
TARGET_PUT_VS_FILE_WRITE = 0.9  # periodic durability; 0.8 under full (a commit per run fsyncs)
TARGET_PUT_VS_FILE_WRITE_FULL = 0.8
TARGET_PUT_VS_LMDB = 0.8  # against a bare LMDB with the same flags, the faster map mode
COMPRESSIONS = ("none", "zstd", "zstd-planes")
DATA_KINDS = ("bf16", "random")


@dataclass(frozen=True)
class Settings:
    """What one run measures, from the command line."""

    total_bytes: int
    payload_bytes: int
    n_blocks: int
    run_blocks: int
    compression: str
    repeat: int
    lookup_repeat: int
    data: str
    durability: str
    root: Path | None
    json: bool
    verbose: bool


# --- set-up ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to make the temporary data directory (default: the system's, /tmp); "
        "the data directory is removed at the end",
    )
    parser.add_argument("--size-mib", type=int, default=DEFAULT_SIZE_MIB, help="bytes moved")
    parser.add_argument("--payload-kib", type=int, default=DEFAULT_PAYLOAD_KIB, help="per block")
    parser.add_argument("--compression", choices=COMPRESSIONS, default="none")
    parser.add_argument("--repeat", type=int, default=DEFAULT_REPEAT, help="timed repetitions")
    parser.add_argument("--run-blocks", type=int, default=DEFAULT_RUN_BLOCKS, help="blocks per put")
    parser.add_argument("--lookup-repeat", type=int, default=DEFAULT_LOOKUP_REPEAT)
    parser.add_argument("--data", choices=DATA_KINDS, default="bf16", help="payload contents")
    parser.add_argument("--durability", choices=("periodic", "full"), default="periodic")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    payload = args.payload_kib * 1024
    total = args.size_mib * MiB
    if args.payload_kib <= 0 or args.size_mib <= 0 or total % payload:
        parser.error("--size-mib must be a positive multiple of --payload-kib")
    if args.repeat < 1 or args.run_blocks < 1 or args.lookup_repeat < 1:
        parser.error("--repeat, --run-blocks and --lookup-repeat must be positive")
    return Settings(
        total_bytes=total,
        payload_bytes=payload,
        n_blocks=total // payload,
        run_blocks=args.run_blocks,
        compression=args.compression,
        repeat=args.repeat,
        lookup_repeat=args.lookup_repeat,
        data=args.data,
        durability=args.durability,
        root=args.dir,
        json=args.json,
        verbose=args.verbose,
    )


def make_payload_bytes(total: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """One preallocated array of `total` bytes; the payloads are slices of it."""
    data = np.empty(total, dtype=np.uint8)
    for start in range(0, total, GEN_CHUNK_BYTES):
        piece = data[start : start + GEN_CHUNK_BYTES]
        if kind == "random":
            piece[:] = rng.integers(0, 256, piece.size, dtype=np.uint8)
        else:  # bf16: the high halves of float32 normals, little-endian like a GPU's KV cache
            values = rng.standard_normal(piece.size // 2, dtype=np.float32)
            piece.view(np.uint16)[:] = values.view(np.uint32) >> 16
    return data


def make_tokens(n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, VOCAB, n_blocks * BLOCK_TOKENS, dtype=np.uint32)


def map_size_of(settings: Settings) -> int:
    return max(8 * GiB, 4 * settings.total_bytes)


def open_store(path: Path, settings: Settings) -> Store:
    return Store.open(
        path,
        durability=settings.durability,
        compression=settings.compression,
        map_size=map_size_of(settings),
    )


def log(settings: Settings, message: str) -> None:
    if settings.verbose:
        print(message, file=sys.stderr, flush=True)


# --- the measured actions --------------------------------------------------------------------


def put_all(
    store: Store, ident: Identity, tokens: np.ndarray, payloads: list[np.ndarray], run_blocks: int
) -> int:
    """Publish every block in runs, each extending the chain; then fsync. Returns blocks stored."""
    stored = 0
    for first in range(0, len(payloads), run_blocks):
        end = min(first + run_blocks, len(payloads))
        prefix = tokens[: end * BLOCK_TOKENS]
        stored += store.put(ident, prefix, payloads[first:end], first_block=first).stored
    store.sync()
    return stored


def put_raw_lmdb(
    path: Path, settings: Settings, payloads: list[np.ndarray], *, writemap: bool
) -> None:
    """The same bytes put into a bare LMDB environment with the store's flags (one value per
    payload, a transaction per run), then one fsync: the floor of what LMDB itself costs, with the
    store's map mode (pages copied at commit) and with LMDB's write map over a file allocated
    ahead (without it a full disk is a SIGBUS), the mode the store does not use."""
    full = settings.durability == "full"
    env = lmdb.open(
        str(path), map_size=map_size_of(settings), sync=full, metasync=full, writemap=writemap
    )
    try:
        if writemap:
            fd = os.open(path / "data.mdb", os.O_RDWR)
            try:
                os.posix_fallocate(fd, 0, settings.total_bytes + settings.total_bytes // 8)
            finally:
                os.close(fd)
        key = 0
        for first in range(0, len(payloads), settings.run_blocks):
            with env.begin(write=True) as txn:
                for payload in payloads[first : first + settings.run_blocks]:
                    txn.put(key.to_bytes(8, "big"), payload)
                    key += 1
        env.sync(True)
    finally:
        env.close()


def write_file(path: Path, payloads: list[np.ndarray]) -> None:
    """Payload-sized writes to a fresh file, then fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for payload in payloads:
            view = memoryview(payload)
            while view.nbytes:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: Path, dests: list[np.ndarray]) -> int:
    """Payload-sized readinto of the whole file into the destination."""
    got = 0
    with open(path, "rb", buffering=0) as f:
        for dest in dests:
            got += f.readinto(memoryview(dest))
    return got


def copy_blocks(dests: list[np.ndarray], sources: list[np.ndarray]) -> None:
    """memcpy in payload-sized pieces, as the store copies: glibc picks its copy strategy by size
    (non-temporal stores only above a threshold that depends on the cache size), so one 1 GiB copy
    and 1024 copies of 1 MiB can differ by more than the store's own overhead."""
    for dest, source in zip(dests, sources):
        np.copyto(dest, source)


def get_load(store: Store, ident: Identity, tokens: np.ndarray, dest: np.ndarray) -> int:
    return store.load(ident, tokens, dest).n_blocks


def get_read_into(
    store: Store, ident: Identity, tokens: np.ndarray, dest: np.ndarray, size: int
) -> int:
    match = store.longest_prefix(ident, tokens)
    return store.read_into(match, split(dest, size)[: match.n_blocks]).n_blocks


# --- phases ----------------------------------------------------------------------------------


def bench_writes(
    settings: Settings,
    workdir: Path,
    ident: Identity,
    tokens: np.ndarray,
    payloads: list[np.ndarray],
    samples: Samples,
) -> tuple[Store, Path]:
    """put, a bare LMDB's put in both map modes and file_write, interleaved, each into fresh
    storage; returns the last store and the file.

    The first round is an untimed warm-up (allocator, page tables, the file system's extents).
    """
    file_path = workdir / "plain.bin"
    run_blocks = settings.run_blocks

    def put() -> float:
        path = workdir / "store"
        removed(path)
        with open_store(path, settings) as store:
            seconds, stored = timed(lambda: put_all(store, ident, tokens, payloads, run_blocks))
        if stored != settings.n_blocks:
            raise RuntimeError(f"put stored {stored} of {settings.n_blocks} blocks")
        return seconds

    def raw(writemap: bool) -> float:
        path = workdir / "raw"
        removed(path)
        path.mkdir()
        seconds, _ = timed(lambda: put_raw_lmdb(path, settings, payloads, writemap=writemap))
        removed(path)
        return seconds

    def plain() -> float:
        removed(file_path)
        return timed(lambda: write_file(file_path, payloads))[0]

    measures: dict[str, Callable[[], float]] = {
        "put": put,
        "lmdb_write_map": lambda: raw(True),
        "lmdb_copying": lambda: raw(False),
        "file_write": plain,
    }
    for round_ in range(settings.repeat + 1):
        # each round in another order: a drift of the machine falls on every measure alike
        names = list(measures)
        names = names[round_ % len(names) :] + names[: round_ % len(names)]
        took = {name: measures[name]() for name in names}
        log(settings, f"round {round_}: " + "  ".join(f"{k} {v:.3f}s" for k, v in took.items()))
        if round_:
            for name, seconds in took.items():
                samples.add(name, seconds)
    return open_store(workdir / "store", settings), file_path


def bench_reads(
    settings: Settings,
    store: Store,
    file_path: Path,
    ident: Identity,
    tokens: np.ndarray,
    source: np.ndarray,
    samples: Samples,
) -> None:
    """memcpy, get (load and read_into) and file_read, interleaved, into one touched destination.

    One untimed warm-up round first; after it the destination is checked against the payloads, so
    the timed gets are known to return the right bytes.
    """
    dest = touched_buffer(settings.total_bytes)
    size = settings.payload_bytes
    dests = split(dest, size)
    sources = split(source, size)
    n = settings.n_blocks
    actions: dict[str, Callable[[], Any]] = {
        "memcpy": lambda: np.copyto(dest, source),
        "memcpy_block": lambda: copy_blocks(dests, sources),
        "get_load": lambda: get_load(store, ident, tokens, dest),
        "get_read_into": lambda: get_read_into(store, ident, tokens, dest, size),
        "file_read": lambda: read_file(file_path, dests),
    }
    expected = {"get_load": n, "get_read_into": n, "file_read": settings.total_bytes}
    names = list(actions)
    for round_ in range(settings.repeat + 1):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            dest.fill(0)  # same start for every measure; and a reader that writes nothing fails
            seconds, result = timed(actions[name])
            if name in expected and result != expected[name]:
                raise RuntimeError(f"{name} returned {result}, expected {expected[name]}")
            if round_ == 0 and not same_bytes(dest, source):
                raise RuntimeError(f"{name} did not reproduce the payloads")
            if round_:
                samples.add(name, seconds)
        if round_:
            timings = "  ".join(f"{k} {samples.seconds[k][-1]:.3f}s" for k in names)
            log(settings, f"round {round_}: {timings}")


def lookup_us(settings: Settings, store: Store, ident: Identity, tokens: np.ndarray) -> float:
    """Median microseconds of longest_prefix over the whole chain (warm)."""
    store.longest_prefix(ident, tokens)
    times = []
    for _ in range(settings.lookup_repeat):
        started = time.perf_counter()
        match = store.longest_prefix(ident, tokens)
        times.append(time.perf_counter() - started)
        if match.n_blocks != settings.n_blocks:
            raise RuntimeError(f"lookup found {match.n_blocks} of {settings.n_blocks} blocks")
    return statistics.median(times) * 1e6


# --- report ----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    import lmdb

    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "lmdb": lmdb.__version__,
    }


def build_report(
    settings: Settings, samples: Samples, store: Store, lookup: float, workdir: Path
) -> dict[str, Any]:
    total = settings.total_bytes
    rate = {name: gbps(total, samples.median(name)) for name in samples.seconds}
    get_method = "load" if rate["get_load"] >= rate["get_read_into"] else "read_into"
    get = max(rate["get_load"], rate["get_read_into"])
    stats = store.stats()
    s = samples.seconds
    # ratios of the same round (the machine's drift cancels), then their median and spread
    lmdb_best = [min(a, b) for a, b in zip(s["lmdb_write_map"], s["lmdb_copying"], strict=True)]
    ratios = {
        "put_vs_file_write": _per_round(s["file_write"], s["put"]),
        "put_vs_lmdb": _per_round(lmdb_best, s["put"]),
        "lmdb_write_map_vs_copying": _per_round(s["lmdb_copying"], s["lmdb_write_map"]),
    }
    put_target = (
        TARGET_PUT_VS_FILE_WRITE_FULL if settings.durability == "full" else TARGET_PUT_VS_FILE_WRITE
    )
    report: dict[str, Any] = {
        "get_gbps": round(get, 3),
        "put_gbps": round(rate["put"], 3),
        "memcpy_gbps": round(rate["memcpy"], 3),
        "file_write_gbps": round(rate["file_write"], 3),
        "file_read_gbps": round(rate["file_read"], 3),
        "get_vs_memcpy": round(get / rate["memcpy"], 3),
        "put_vs_file_write": ratios["put_vs_file_write"][0],
        "lmdb_write_map_gbps": round(rate["lmdb_write_map"], 3),
        "lmdb_copying_gbps": round(rate["lmdb_copying"], 3),
        "ratios": {name: {"median": m, "spread": spread} for name, (m, spread) in ratios.items()},
        "get_method": get_method,
        "get_load_gbps": round(rate["get_load"], 3),
        "get_read_into_gbps": round(rate["get_read_into"], 3),
        "memcpy_block_gbps": round(rate["memcpy_block"], 3),
        "get_vs_memcpy_block": round(get / rate["memcpy_block"], 3),
        "get_vs_file_read": round(get / rate["file_read"], 3),
        "lookup_us": round(lookup, 1),
        "targets": {
            "get_vs_memcpy": TARGET_GET_VS_MEMCPY,
            "put_vs_file_write": put_target,
            "put_vs_lmdb": TARGET_PUT_VS_LMDB,
        },
        "meets_targets": {
            "get_vs_memcpy": get / rate["memcpy"] >= TARGET_GET_VS_MEMCPY,
            "put_vs_file_write": ratios["put_vs_file_write"][0] >= put_target,
            "put_vs_lmdb": ratios["put_vs_lmdb"][0] >= TARGET_PUT_VS_LMDB,
        },
        "compression_ratio": round(stats.compression_ratio, 4),
        "store": {
            "blocks": stats.blocks,
            "payload_bytes": stats.payload_bytes,
            "stored_bytes": stats.stored_bytes,
            "map_used_bytes": stats.map_used_bytes,
            "compress_gbps": round(stats.compress_gbps, 3),
            "decompress_gbps": round(stats.decompress_gbps, 3),
            "compressed_payloads_stored_raw": stats.compressed_payloads_stored_raw,
            "verify_failures": stats.verify_failures,
        },
        "settings": {
            "size_mib": total // MiB,
            "payload_kib": settings.payload_bytes // 1024,
            "n_blocks": settings.n_blocks,
            "block_tokens": BLOCK_TOKENS,
            "run_blocks": settings.run_blocks,
            "compression": settings.compression,
            "durability": settings.durability,
            "data": settings.data,
            "repeat": settings.repeat,
            "dir": str(workdir),
        },
        "seconds": {k: [round(s, 4) for s in v] for k, v in samples.seconds.items()},
        "machine": machine_info(),
    }
    return report


def _per_round(reference: list[float], measured: list[float]) -> tuple[float, list[float]]:
    """The rate of `measured` over `reference`'s, round by round: the median and [min, max]."""
    each = [ref / took for ref, took in zip(reference, measured, strict=True)]
    return round(statistics.median(each), 3), [round(min(each), 3), round(max(each), 3)]


def print_table(report: dict[str, Any]) -> None:
    s = report["settings"]
    print(
        f"prefixd store bench: {s['size_mib']} MiB in {s['n_blocks']} x {s['payload_kib']} KiB, "
        f"compression={s['compression']}, median of {s['repeat']}"
    )
    rows = [
        ("put (+fsync)", report["put_gbps"]),
        ("bare LMDB, write map", report["lmdb_write_map_gbps"]),
        ("bare LMDB, copying", report["lmdb_copying_gbps"]),
        ("file write (+fsync)", report["file_write_gbps"]),
        ("get, load", report["get_load_gbps"]),
        ("get, read_into", report["get_read_into_gbps"]),
        ("memcpy", report["memcpy_gbps"]),
        ("memcpy, per payload", report["memcpy_block_gbps"]),
        ("file readinto", report["file_read_gbps"]),
    ]
    for name, value in rows:
        print(f"  {name:<22}{value:>8.2f} GB/s")
    met = report["meets_targets"]
    target = report["targets"]
    print(
        f"  get / memcpy      {report['get_vs_memcpy']:>6.2f}  (target {target['get_vs_memcpy']}: "
        f"{'met' if met['get_vs_memcpy'] else 'MISSED'})"
    )
    for name in ("put_vs_file_write", "put_vs_lmdb"):
        ratio = report["ratios"][name]
        print(
            f"  {name:<18}{ratio['median']:>6.2f}  spread {ratio['spread']}  (target "
            f"{target[name]}: {'met' if met[name] else 'MISSED'})"
        )
    for name in ("lmdb_write_map_vs_copying",):
        ratio = report["ratios"][name]
        print(f"  {name:<18}{ratio['median']:>6.2f}  spread {ratio['spread']}")
    print(
        f"  lookup of the whole chain {report['lookup_us']:.0f} us, "
        f"compression ratio {report['compression_ratio']:.3f}"
    )


# --- main ------------------------------------------------------------------------------------


def run(settings: Settings, workdir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(SEED)
    log(settings, f"generating {settings.total_bytes // MiB} MiB of {settings.data} payloads")
    source = make_payload_bytes(settings.total_bytes, settings.data, rng)
    payloads = split(source, settings.payload_bytes)
    tokens = make_tokens(settings.n_blocks, rng)
    ident = bench_identity(BLOCK_TOKENS, settings.payload_bytes)
    samples = Samples()
    store, file_path = bench_writes(settings, workdir, ident, tokens, payloads, samples)
    try:
        bench_reads(settings, store, file_path, ident, tokens, source, samples)
        lookup = lookup_us(settings, store, ident, tokens)
        return build_report(settings, samples, store, lookup, workdir)
    finally:
        store.close()


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_args(argv)
    keep_write_buffers()  # as `prefixd serve` runs (prefixd.store.allocator)
    if settings.root is not None:
        settings.root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="prefixd-bench-", dir=settings.root))
    try:
        report = run(settings, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if settings.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
