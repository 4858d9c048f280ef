"""Loads that scale with clients: N client processes loading the same stored chain through one
daemon at once, next to N processes copying the same bytes with numpy, in the same run.

One daemon (`python -m prefixd serve`) serves a store of `--size-mib` of `--block-kib` payloads
stored raw (one chain, written with the library before the daemon starts). For each N in
`--clients` (1, 4, 16; 32 too with `--full`), N processes start, each with its own `Client` and
its own shared region, and step through the same phases together (a barrier before each):

* load:    every process loads the whole chain (`Client.load`, verified by the daemon) into its
           region; aggregate GB/s = N x the chain's bytes / (the last end - the first start).
* memcpy:  every process copies the same bytes (`numpy.copyto`, one call) from one source array
           shared by all of them (as the page cache of data.mdb is shared by every load) into a
           preallocated, touched buffer of its own: the ceiling on the same cores.

The two alternate (their order rotating) over `--rounds` timed rounds after an untimed warm-up;
the figures are the medians of the rounds, and the p50/p99 of every single load's latency.
`load_vs_memcpy` is the target ratio (>= 0.5 at 4 and 16 clients).

A last section, `fairness`, measures small loads (`--small-blocks` blocks) by `--small-clients`
processes, each in a loop, alone and then beside `--hogs` processes loading the whole chain in a
loop: a huge load must not make the small ones wait for it (the p99 ratio with/without).

Every region is zeroed before and compared byte for byte after the warm-up's and the last
round's load (outside the timing, with every process stopped at a barrier); in between, sampled
bytes of every block are compared. GB/s means 1e9 bytes per second.

    python bench/load_clients.py --json
    python bench/load_clients.py --clients 1,4,16 --size-mib 128 --rounds 5 -v

`measure(...)` returns the report as a dict (for other benchmarks to call).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.synchronize
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import bench_identity, same_bytes, split, touched_buffer
from suitelib import GiB, MiB, SuiteDaemon, percentiles_us, ratio

from prefixd import Identity, Store
from prefixd.client import Client

BLOCK_TOKENS = 256
SEED = 20240617
TARGET = 0.5
REGION_SLACK = 4 * MiB
PHASE_TIMEOUT_S = 600.0


def _shared_source(total: int) -> np.ndarray:
    """The payload bytes: random (incompressible, as the store keeps them raw)."""
    return np.random.default_rng(SEED).integers(0, 256, total, dtype=np.uint8)


def _store_chain(data_dir: Path, ident: Identity, source: np.ndarray, block: int) -> np.ndarray:
    payloads = split(source, block)
    tokens = np.arange(len(payloads) * BLOCK_TOKENS, dtype=np.uint32)
    with Store.open(data_dir, map_size=2 * source.nbytes + GiB, verify_threads=0) as store:
        for first in range(0, len(payloads), 64):
            end = min(first + 64, len(payloads))
            result = store.put(
                ident, tokens[: end * BLOCK_TOKENS], payloads[first:end], first_block=first
            )
            if result.stored != end - first:
                raise RuntimeError(f"stored {result.stored} of blocks {first}..{end}")
        store.sync()
    return tokens


def _sample_ok(
    region: np.ndarray, source: np.ndarray, block: int, rng: np.random.Generator
) -> bool:
    """64 bytes at a random place in every block agree with the source."""
    for start in range(0, source.size, block):
        at = start + int(rng.integers(0, max(1, min(block, source.size - start) - 64)))
        if not np.array_equal(region[at : at + 64], source[at : at + 64]):
            return False
    return True


def cpu_seconds(pid: int) -> float:
    """CPU time every thread of process `pid` has run so far (/proc/<pid>/task/*/schedstat)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total / 1e9


def _client_main(
    index: int,
    socket_path: str,
    daemon_pid: int,
    ident: Identity,
    tokens: np.ndarray,
    source: np.ndarray,
    block: int,
    phases: Sequence[str],
    barrier: multiprocessing.synchronize.Barrier,
    results: Any,
) -> None:
    """One client process: run `phases` (load, memcpy, check-load) in step with the others and
    put its (phase index, name, start, end, daemon CPU seconds) timings on `results` (client 0
    reads the daemon's CPU time around each phase, the others report 0)."""
    timings: list[tuple[int, str, float, float, float]] = []
    error = ""
    try:
        total = source.nbytes
        rng = np.random.default_rng((SEED, index))
        with Client(socket_path, region_bytes=total + REGION_SLACK, timeout=PHASE_TIMEOUT_S) as c:
            assert c.region is not None
            region = np.frombuffer(c.region.view, dtype=np.uint8)[:total]
            region.fill(0)
            dest = touched_buffer(total)
            for step, phase in enumerate(phases):
                full_check = phase == "check-load"
                if phase != "memcpy":
                    region.fill(0)  # a load that writes nothing fails the check
                cpu = cpu_seconds(daemon_pid) if index == 0 else 0.0
                barrier.wait(PHASE_TIMEOUT_S)
                started = time.perf_counter()
                if phase == "memcpy":
                    np.copyto(dest, source)
                    n_blocks = -1
                else:
                    with c.load(ident, tokens) as loaded:
                        n_blocks = loaded.n_blocks
                ended = time.perf_counter()
                barrier.wait(PHASE_TIMEOUT_S)  # nobody checks while another still runs
                cpu = cpu_seconds(daemon_pid) - cpu if index == 0 else 0.0
                if phase != "memcpy":
                    if n_blocks * block != total:
                        raise RuntimeError(f"client {index}: loaded {n_blocks} blocks")
                    good = same_bytes(region, source) if full_check else True
                    if not good or not _sample_ok(region, source, block, rng):
                        raise RuntimeError(f"client {index}: a load did not give the payloads")
                kind = "memcpy" if phase == "memcpy" else "load"
                timings.append((step, kind, started, ended, cpu))
                barrier.wait(PHASE_TIMEOUT_S)
    except BaseException as exc:  # reported to the parent, which fails the run  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
        barrier.abort()
    results.put((index, timings, error))


def _loop_client(
    index: int,
    socket_path: str,
    ident: Identity,
    tokens: np.ndarray,
    n_blocks: int,
    nbytes: int,
    seconds: float,
    start: multiprocessing.synchronize.Barrier,
    results: Any,
) -> None:
    """Load the first `nbytes` of the chain in a loop for `seconds`; put the latencies."""
    latencies: list[float] = []
    error = ""
    try:
        prompt = tokens[: n_blocks * ident.block_tokens]
        with Client(socket_path, region_bytes=nbytes + REGION_SLACK, timeout=PHASE_TIMEOUT_S) as c:
            start.wait(PHASE_TIMEOUT_S)
            until = time.perf_counter() + seconds
            while time.perf_counter() < until:
                began = time.perf_counter()
                with c.load(ident, prompt) as loaded:
                    if sum(loaded.sizes) != nbytes:
                        raise RuntimeError(f"loaded {sum(loaded.sizes)} of {nbytes} bytes")
                latencies.append(time.perf_counter() - began)
    except BaseException as exc:  # noqa: BLE001
        error = f"{type(exc).__name__}: {exc}"
        start.abort()
    results.put((index, latencies, error))


def _collect(ctx: Any, procs: list[Any], results: Any) -> list[tuple[int, Any, str]]:
    got = [results.get(timeout=PHASE_TIMEOUT_S * 4) for _ in procs]
    for proc in procs:
        proc.join(PHASE_TIMEOUT_S)
    errors = [e for _, _, e in got if e]
    if errors:
        raise RuntimeError("a client process failed: " + "; ".join(errors[:3]))
    return sorted(got, key=lambda g: g[0])


def _run_clients(
    socket_path: str,
    daemon_pid: int,
    n: int,
    ident: Identity,
    tokens: np.ndarray,
    source: np.ndarray,
    block: int,
    rounds: int,
) -> dict[str, Any]:
    """One N: the phases of every round (warm-up first), their aggregate GB/s and latencies."""
    phases: list[str] = []
    for round_ in range(rounds + 1):
        pair = ["load", "memcpy"] if round_ % 2 == 0 else ["memcpy", "load"]
        if round_ in (0, rounds):
            pair = [p if p == "memcpy" else "check-load" for p in pair]
        phases += pair
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_client_main,
            args=(
                i,
                socket_path,
                daemon_pid,
                ident,
                tokens,
                source,
                block,
                phases,
                barrier,
                results,
            ),
            daemon=True,
        )
        for i in range(n)
    ]
    for proc in procs:
        proc.start()
    got = _collect(ctx, procs, results)
    warm_steps = 2  # round 0's two phases
    spans: dict[str, list[float]] = {"load": [], "memcpy": []}
    latencies: list[float] = []
    daemon_cpu = 0.0
    for step in range(warm_steps, len(phases)):
        kind = "memcpy" if phases[step] == "memcpy" else "load"
        starts, ends = [], []
        for _, timings, _ in got:
            for s, _, began, ended, cpu in timings:
                if s == step:
                    starts.append(began)
                    ends.append(ended)
                    if kind == "load":
                        latencies.append(ended - began)
                        daemon_cpu += cpu
        spans[kind].append(max(ends) - min(starts))
    total = n * source.nbytes
    load = total / statistics.median(spans["load"]) / 1e9
    memcpy = total / statistics.median(spans["memcpy"]) / 1e9
    return {
        "clients": n,
        "load_gbps": round(load, 3),
        "memcpy_gbps": round(memcpy, 3),
        "load_vs_memcpy": ratio(load, memcpy),
        # cores the daemon kept busy during the load phases (its CPU time / their wall time)
        "daemon_cores": round(daemon_cpu / sum(spans["load"]), 2),
        "load_ms": {k: round(v / 1e3, 2) for k, v in percentiles_us(latencies).items() if k != "n"}
        | {"n": len(latencies)},
        "round_s": {k: [round(s, 4) for s in v] for k, v in spans.items()},
    }


def _fairness(
    socket_path: str,
    ident: Identity,
    tokens: np.ndarray,
    total: int,
    block: int,
    *,
    small_blocks: int,
    small_clients: int,
    hogs: int,
    seconds: float,
) -> dict[str, Any]:
    """Small loads' latency alone and beside `hogs` loops of whole-chain loads."""
    ctx = multiprocessing.get_context("fork")
    report: dict[str, Any] = {
        "small_bytes": small_blocks * block,
        "small_clients": small_clients,
        "hogs": hogs,
        "seconds": seconds,
    }
    for label, n_hogs in (("alone", 0), ("beside_hogs", hogs)):
        barrier = ctx.Barrier(small_clients + n_hogs)
        results = ctx.Queue()
        blocks = [small_blocks] * small_clients + [total // block] * n_hogs
        procs = [
            ctx.Process(
                target=_loop_client,
                args=(i, socket_path, ident, tokens, b, b * block, seconds, barrier, results),
                daemon=True,
            )
            for i, b in enumerate(blocks)
        ]
        for proc in procs:
            proc.start()
        got = _collect(ctx, procs, results)
        small = [lat for i, lats, _ in got if i < small_clients for lat in lats]
        hog = [lat for i, lats, _ in got if i >= small_clients for lat in lats]
        report[label] = {
            "small_ms": {k: round(v / 1e3, 2) for k, v in percentiles_us(small).items()}
            | {"n": len(small)},
            "hog_loads": len(hog),
            "hog_gbps": round(len(hog) * total / seconds / 1e9, 3),
        }
    report["small_p99_ratio"] = ratio(
        report["beside_hogs"]["small_ms"]["p99"], report["alone"]["small_ms"]["p99"]
    )
    return report


def measure(
    root: Path,
    *,
    clients: Sequence[int] = (1, 4, 16),
    size_mib: int = 128,
    block_kib: int = 1024,
    rounds: int = 5,
    fairness: bool = True,
    small_blocks: int = 4,
    small_clients: int = 3,
    hogs: int = 3,
    fairness_s: float = 3.0,
    daemon_args: Sequence[str] = (),
    log: Any = None,
) -> dict[str, Any]:
    """Run the whole bench under `root` (a fresh directory of its own); return the report."""
    say = log or (lambda message: None)
    block = block_kib * 1024
    total = size_mib * MiB // block * block
    source = _shared_source(total)
    ident = bench_identity(BLOCK_TOKENS, block, tenant="bench-clients")
    daemon = SuiteDaemon(root, "load-clients", map_size=2 * total + GiB, extra=list(daemon_args))
    tokens = _store_chain(daemon.data_dir, ident, source, block)
    say(f"stored {total // block} blocks of {block_kib} KiB")
    rows = []
    with daemon:
        say(f"daemon pid {daemon.pid}")
        for n in clients:
            row = _run_clients(
                str(daemon.socket), daemon.pid, n, ident, tokens, source, block, rounds
            )
            say(json.dumps({k: v for k, v in row.items() if k != "round_s"}))
            rows.append(row)
        fair = None
        if fairness:
            fair = _fairness(
                str(daemon.socket),
                ident,
                tokens,
                total,
                block,
                small_blocks=small_blocks,
                small_clients=small_clients,
                hogs=hogs,
                seconds=fairness_s,
            )
            say(json.dumps(fair))
        with Client(daemon.socket) as client:
            stats = client.stats()
    targets = {str(r["clients"]): r["load_vs_memcpy"] for r in rows if r["clients"] in (4, 16)}
    return {
        "rows": rows,
        "fairness": fair,
        "target_load_vs_memcpy": TARGET,
        "meets_target": {k: v is not None and v >= TARGET for k, v in targets.items()},
        "daemon_loaded_bytes": stats.get("loaded_bytes"),
        "settings": {
            "size_mib": size_mib,
            "block_kib": block_kib,
            "rounds": rounds,
            "daemon_args": list(daemon_args),
        },
        "machine": {"cpus": os.cpu_count(), "cores_usable": len(os.sched_getaffinity(0))},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--clients", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--full", action="store_true", help="32 clients too")
    parser.add_argument("--size-mib", type=int, default=128, help="the chain's payload bytes")
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per client count")
    parser.add_argument("--fairness-s", type=float, default=3.0, help="per fairness phase")
    parser.add_argument("--no-fairness", action="store_true", help="skip the fairness section")
    parser.add_argument("--daemon-arg", action="append", default=[], help="extra serve flags")
    parser.add_argument("--dir", type=Path, default=None, help="where the temporary store goes")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    clients = [int(c) for c in args.clients.split(",") if c]
    if args.full and 32 not in clients:
        clients.append(32)

    def log(message: str) -> None:
        if args.verbose:
            print(message, file=sys.stderr, flush=True)

    root = Path(tempfile.mkdtemp(prefix="prefixd-clients-", dir=args.dir))
    try:
        report = measure(
            root,
            clients=clients,
            size_mib=args.size_mib,
            block_kib=args.block_kib,
            rounds=args.rounds,
            fairness=not args.no_fairness,
            fairness_s=args.fairness_s,
            daemon_args=args.daemon_arg,
            log=log,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for row in report["rows"]:
            ms = row["load_ms"]
            print(
                f"  {row['clients']:>3} clients  load {row['load_gbps']:>6.2f} GB/s  memcpy "
                f"{row['memcpy_gbps']:>6.2f} GB/s  ratio {row['load_vs_memcpy']}  "
                f"p50 {ms['p50']} ms  p99 {ms['p99']} ms"
            )
        fair = report["fairness"]
        if fair:
            print(
                f"  small loads p99 alone {fair['alone']['small_ms']['p99']} ms, beside "
                f"{fair['hogs']} hogs {fair['beside_hogs']['small_ms']['p99']} ms "
                f"(x{fair['small_p99_ratio']})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
