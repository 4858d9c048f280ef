"""prefixd's benchmark suite: workloads, hardware ratios, peers and scale, in one run.

    python bench/run.py [--quick] [--json]

Sections (all in one run, on one machine; `--sections` picks some):

* workloads: four request traces (bench/workloads.py: one long shared prefix; multi-turn chat,
  conversations by Zipf; RAG over shared documents; a hot-spot drift under a capacity limit) run
  against a real daemon through `prefixd.client.Client` with an engine's loop per request: lookup,
  load the hit (every byte checked), put the missing closed blocks. Per trace: request-, token- and
  byte-weighted hit rates, the hit-length histogram, the stage times (p50/p99 us), the throughput,
  and the prefill time saved at an assumed prefill throughput (`--prefill-tokens-per-s`).
* ratios: load GB/s against memcpy and against a plain file read of the same bytes; put GB/s
  (a daemon with `--durability full`) against a plain file write + fsync (bench/ratios.py).
* peers: the same traces, bytes and loop against Redis (Debian's redis-server, started here on a
  Unix socket with append-only persistence) and diskcache, each block under its chain hash
  (bench/peers.py); prefixd's ratio to each, in requests/s and load GB/s. A peer that is not
  installed is reported as {"skipped": reason}.
* scale: a store of 1,000,000 entries (`--scale-entries`) against one of 1,000: lookup latency,
  daemon RSS and daemon start time, as ratios large / small (bench/scale.py).

`--quick` runs every section with small sizes in seconds (the test suite runs it). GB/s means 1e9
bytes per second. Everything lives in temporary directories, removed at the end.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import peers
import ratios
import scale
import workloads as wl
from benchlib import bench_identity, run_in_workdir
from suitelib import MiB, SuiteDaemon, machine_info, ratio

from prefixd.client import Client

SECTIONS = ("workloads", "ratios", "peers", "scale")
PEER_WORKLOADS = ("shared_prefix", "chat", "rag")  # unbounded: every cache should hit alike
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0
DEFAULT_SEED = 20240601


@dataclass(frozen=True)
class Preset:
    """The sizes of one mode."""

    block_tokens: int
    payload_bytes: int
    pool_bytes: int
    shared_prefix: dict[str, Any]
    chat: dict[str, Any]
    rag: dict[str, Any]
    drift: dict[str, Any]
    ratio_bytes: int
    ratio_block_bytes: int
    ratio_repeat: int
    ratio_run_blocks: int
    scale_entries: int
    scale_lookups: int
    scale_warmup: int


FULL = Preset(
    block_tokens=256,
    payload_bytes=64 << 10,
    pool_bytes=64 * MiB,
    shared_prefix={"requests": 200, "prefix_blocks": 32, "suffix_tokens": (64, 1024)},
    chat={
        "requests": 400,
        "conversations": 64,
        "system_blocks": 4,
        "user_tokens": (32, 512),
        "reply_tokens": (64, 768),
        "max_history_blocks": 64,
    },
    rag={
        "requests": 300,
        "documents": 200,
        "per_request": 3,
        "document_tokens": (512, 3072),
        "system_blocks": 2,
        "question_tokens": (32, 256),
    },
    drift={
        "phases": 4,
        "requests_per_phase": 100,
        "pool": 128,
        "hot_set": 32,
        "shift": 24,
        "prefix_blocks": 16,
        "suffix_tokens": (64, 512),
    },
    ratio_bytes=256 * MiB,
    ratio_block_bytes=1 * MiB,
    ratio_repeat=3,
    ratio_run_blocks=64,
    scale_entries=1_000_000,
    scale_lookups=2000,
    scale_warmup=200,
)

QUICK = Preset(
    block_tokens=16,
    payload_bytes=2 << 10,
    pool_bytes=1 * MiB,
    shared_prefix={"requests": 30, "prefix_blocks": 16, "suffix_tokens": (8, 64)},
    chat={
        "requests": 60,
        "conversations": 12,
        "system_blocks": 2,
        "user_tokens": (8, 40),
        "reply_tokens": (8, 64),
        "max_history_blocks": 24,
    },
    rag={
        "requests": 40,
        "documents": 30,
        "per_request": 3,
        "document_tokens": (32, 128),
        "system_blocks": 2,
        "question_tokens": (8, 40),
    },
    drift={
        "phases": 3,
        "requests_per_phase": 20,
        "pool": 24,
        "hot_set": 6,
        "shift": 5,
        "prefix_blocks": 8,
        "suffix_tokens": (8, 32),
    },
    ratio_bytes=8 * MiB,
    ratio_block_bytes=64 << 10,
    ratio_repeat=2,
    ratio_run_blocks=64,
    scale_entries=20_000,
    scale_lookups=300,
    scale_warmup=30,
)

CAPACITY_SHARE_OF_HOT_SET = 1.5  # the drift daemon holds 1.5x one phase's popular prefixes


@dataclass(frozen=True)
class Settings:
    quick: bool
    json: bool
    verbose: bool
    sections: tuple[str, ...]
    prefill_tokens_per_s: float
    capacity_bytes: int | None
    scale_entries: int
    seed: int
    root: Path | None
    preset: Preset


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="small sizes: every section in seconds"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        help="assumed prefill throughput, for the prefill time saved (default %(default)s)",
    )
    parser.add_argument(
        "--capacity-bytes",
        type=int,
        default=None,
        help="the drift daemon's --capacity-bytes (default: 1.5x one phase's popular prefixes)",
    )
    parser.add_argument(
        "--scale-entries",
        type=int,
        default=None,
        help="entries of the large store (default 1000000; 20000 with --quick)",
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated, of {', '.join(SECTIONS)} (default: all; peers needs workloads)",
    )
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument(
        "--dir", type=Path, default=None, help="where to make the temporary directory (/tmp)"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    sections = tuple(s for s in args.sections.split(",") if s)
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections: {', '.join(sorted(unknown))}")
    if "peers" in sections and "workloads" not in sections:
        parser.error("the peers section compares with the workloads section: name both")
    if args.prefill_tokens_per_s <= 0:
        parser.error("--prefill-tokens-per-s must be positive")
    if args.capacity_bytes is not None and args.capacity_bytes <= 0:
        parser.error("--capacity-bytes must be positive")
    preset = QUICK if args.quick else FULL
    scale_entries = preset.scale_entries if args.scale_entries is None else args.scale_entries
    if scale_entries < scale.SMALL_ENTRIES:
        parser.error(f"--scale-entries must be at least {scale.SMALL_ENTRIES}")
    return Settings(
        quick=args.quick,
        json=args.json,
        verbose=args.verbose,
        sections=tuple(s for s in SECTIONS if s in sections),
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        capacity_bytes=args.capacity_bytes,
        scale_entries=scale_entries,
        seed=args.seed,
        root=args.dir,
        preset=preset,
    )


def log(settings: Settings, message: str) -> None:
    if settings.verbose:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- workloads -------------------------------------------------------------------------------


def make_workloads(settings: Settings) -> list[wl.Workload]:
    p = settings.preset
    makers: dict[str, Callable[..., wl.Workload]] = {
        "shared_prefix": wl.shared_prefix,
        "chat": wl.chat,
        "rag": wl.rag,
        "drift": wl.drift,
    }
    traces = []
    for i, (name, make) in enumerate(makers.items()):
        rng = np.random.default_rng((settings.seed, i))
        ident = bench_identity(p.block_tokens, p.payload_bytes, f"bench-{name}")
        traces.append(make(rng, ident, **getattr(p, name)))
    drift = traces[-1]
    hot_bytes = p.drift["hot_set"] * p.drift["prefix_blocks"] * p.payload_bytes
    drift.capacity_bytes = settings.capacity_bytes or int(hot_bytes * CAPACITY_SHARE_OF_HOT_SET)
    drift.params["capacity_bytes"] = drift.capacity_bytes
    drift.params["hot_set_bytes"] = hot_bytes
    return traces


def region_bytes(traces: Sequence[wl.Workload], payload_bytes: int) -> int:
    return max(t.max_blocks for t in traces) * payload_bytes + MiB


def run_trace(
    settings: Settings,
    backend: wl.Backend,
    trace: wl.Workload,
    payloads: wl.Payloads,
) -> tuple[wl.Tally, dict[str, Any]]:
    gc.collect()
    started = time.perf_counter()
    tally = wl.drive(backend, trace, payloads)
    seconds = time.perf_counter() - started
    summary = wl.summarize(tally, trace, settings.prefill_tokens_per_s, seconds)
    log(
        settings,
        f"{backend.name} {trace.name}: {tally.requests} requests in {seconds:.2f}s, "
        f"token hit rate {summary['token_hit_rate']:.3f}",
    )
    return tally, summary


def section_workloads(
    settings: Settings, workdir: Path, traces: list[wl.Workload], payloads: wl.Payloads
) -> tuple[dict[str, Any], dict[str, wl.Tally]]:
    results: dict[str, Any] = {}
    tallies: dict[str, wl.Tally] = {}
    region = region_bytes(traces, payloads.size)
    # The unbounded traces share one daemon (a tenant each); every bounded one gets its own.
    groups = [("workloads", [], [t for t in traces if not t.capacity_bytes])]
    groups += [
        (f"workloads-{t.name}", ["--capacity-bytes", str(t.capacity_bytes)], [t])
        for t in traces
        if t.capacity_bytes
    ]
    for name, extra, group in groups:
        daemon = SuiteDaemon(workdir, name, extra=extra)
        with daemon, Client(daemon.socket, region_bytes=region, timeout=300) as client:
            log(settings, f"daemon {name} ready in {daemon.start_s:.2f}s")
            backend = wl.PrefixdBackend(client, payloads)
            for trace in group:
                tally, summary = run_trace(settings, backend, trace, payloads)
                summary["description"] = trace.description
                summary["params"] = trace.params
                tallies[trace.name] = tally
                results[trace.name] = summary
            store = client.stats()["store"]
            for trace in group:
                results[trace.name]["daemon"] = {
                    "name": name,
                    "capacity_bytes": trace.capacity_bytes or None,
                    "store_blocks": store["blocks"],
                    "store_stored_bytes": store["stored_bytes"],
                    "put_retries": backend.put_retries,
                }
    return results, tallies


# --- peers -----------------------------------------------------------------------------------


def peer_report(
    settings: Settings,
    backend: wl.Backend,
    traces: list[wl.Workload],
    payloads: wl.Payloads,
    ours: dict[str, Any],
    our_tallies: dict[str, wl.Tally],
) -> dict[str, Any]:
    per_workload: dict[str, Any] = {}
    for trace in traces:
        tally, summary = run_trace(settings, backend, trace, payloads)
        mine = ours[trace.name]
        per_workload[trace.name] = {
            "requests_per_s": summary["requests_per_s"],
            "load_gbps": summary["load_gbps"],
            "put_gbps": summary["put_gbps"],
            "token_hit_rate": summary["token_hit_rate"],
            "same_hits_as_prefixd": tally.hit_blocks == our_tallies[trace.name].hit_blocks,
            "stages_us": summary["stages_us"],
            "prefixd_ratio": {
                "requests_per_s": ratio(
                    mine["requests_per_s"] or 0, summary["requests_per_s"] or 0
                ),
                "load_gbps": ratio(mine["load_gbps"] or 0, summary["load_gbps"] or 0),
                "put_gbps": ratio(mine["put_gbps"] or 0, summary["put_gbps"] or 0),
            },
            "_tally": tally,
        }
    total = _totals([w.pop("_tally") for w in per_workload.values()])
    mine = _totals([our_tallies[t.name] for t in traces])
    return {
        "workloads": per_workload,
        "total": total,
        "prefixd_ratio": {
            "requests_per_s": ratio(mine["requests_per_s"], total["requests_per_s"]),
            "load_gbps": ratio(mine["load_gbps"], total["load_gbps"]),
            "put_gbps": ratio(mine["put_gbps"], total["put_gbps"]),
        },
    }


def _totals(tallies: Sequence[wl.Tally]) -> dict[str, float]:
    stage = {name: sum(sum(t.stage_s[name]) for t in tallies) for name in ("lookup", "load", "put")}
    requests = sum(t.requests for t in tallies)
    busy = sum(stage.values())
    return {
        "requests": requests,
        "requests_per_s": round(requests / busy, 1) if busy else 0.0,
        "load_gbps": round(sum(t.loaded_bytes for t in tallies) / stage["load"] / 1e9, 3)
        if stage["load"]
        else 0.0,
        "put_gbps": round(sum(t.put_bytes for t in tallies) / stage["put"] / 1e9, 3)
        if stage["put"]
        else 0.0,
    }


def section_peers(
    settings: Settings,
    workdir: Path,
    traces: list[wl.Workload],
    payloads: wl.Payloads,
    ours: dict[str, Any],
    our_tallies: dict[str, wl.Tally],
) -> dict[str, Any]:
    chosen = [t for t in traces if t.name in PEER_WORKLOADS]
    dest_bytes = region_bytes(chosen, payloads.size)
    mine = _totals([our_tallies[t.name] for t in chosen])
    result: dict[str, Any] = {
        "workloads": [t.name for t in chosen],
        "prefixd": mine,
        "versions": peers.versions(),
    }
    reason = peers.redis_unavailable()
    if reason:
        result["redis"] = {"skipped": reason}
    else:
        redis_dir = Path(tempfile.mkdtemp(prefix="pxr-"))  # short: it holds the socket
        try:
            with peers.RedisServer(redis_dir) as server, server.client() as client:
                backend = peers.RedisBackend(client, dest_bytes)
                result["redis"] = peer_report(
                    settings, backend, chosen, payloads, ours, our_tallies
                )
                result["redis"]["server"] = {**server.info(), "start_s": round(server.start_s, 3)}
                result["redis"]["server"]["command"] = " ".join(
                    repr(a) if not a else a for a in server.command()
                )
        finally:
            shutil.rmtree(redis_dir, ignore_errors=True)
    reason = peers.diskcache_unavailable()
    if reason:
        result["diskcache"] = {"skipped": reason}
    else:
        cache = peers.open_diskcache(workdir / "diskcache")
        try:
            backend = peers.DiskcacheBackend(cache, dest_bytes)
            result["diskcache"] = peer_report(
                settings, backend, chosen, payloads, ours, our_tallies
            )
        finally:
            cache.close()
    return result


# --- the run ---------------------------------------------------------------------------------


def run(settings: Settings, workdir: Path) -> dict[str, Any]:
    loadavg_start = os.getloadavg()
    started = time.perf_counter()
    p = settings.preset
    report: dict[str, Any] = {
        "suite": "prefixd bench (bench/run.py)",
        "mode": "quick" if settings.quick else "full",
        "settings": {
            "sections": list(settings.sections),
            "seed": settings.seed,
            "prefill_tokens_per_s": settings.prefill_tokens_per_s,
            "block_tokens": p.block_tokens,
            "payload_bytes": p.payload_bytes,
            "scale_entries": settings.scale_entries,
            "preset": asdict(p),
            "dir": str(workdir),
        },
    }
    section_s: dict[str, float] = {}
    if "workloads" in settings.sections:
        t0 = time.perf_counter()
        rng = np.random.default_rng((settings.seed, 99))
        payloads = wl.Payloads(p.payload_bytes, p.pool_bytes, rng)
        traces = make_workloads(settings)
        log(settings, f"traces: {', '.join(f'{t.name} {len(t.prompts)}' for t in traces)}")
        results, tallies = section_workloads(settings, workdir, traces, payloads)
        report["workloads"] = results
        section_s["workloads"] = round(time.perf_counter() - t0, 3)
        if "peers" in settings.sections:
            t0 = time.perf_counter()
            report["peers"] = section_peers(settings, workdir, traces, payloads, results, tallies)
            section_s["peers"] = round(time.perf_counter() - t0, 3)
    if "ratios" in settings.sections:
        t0 = time.perf_counter()
        report["ratios"] = ratios.measure(
            workdir,
            size_bytes=p.ratio_bytes,
            block_bytes=p.ratio_block_bytes,
            repeat=p.ratio_repeat,
            run_blocks=p.ratio_run_blocks,
        )
        section_s["ratios"] = round(time.perf_counter() - t0, 3)
        log(settings, f"ratios in {section_s['ratios']:.1f}s")
    if "scale" in settings.sections:
        t0 = time.perf_counter()
        report["scale"] = scale.measure(
            workdir,
            large_entries=settings.scale_entries,
            lookups=p.scale_lookups,
            warmup=p.scale_warmup,
        )
        section_s["scale"] = round(time.perf_counter() - t0, 3)
        log(settings, f"scale in {section_s['scale']:.1f}s")
    report["section_s"] = section_s
    report["total_s"] = round(time.perf_counter() - started, 3)
    report["machine"] = machine_info(loadavg_start)
    return report


# --- the table -------------------------------------------------------------------------------


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(report: dict[str, Any]) -> None:
    m, s = report["machine"], report["settings"]
    print(
        f"prefixd bench ({report['mode']}): {m['cpu_model']}, {m['cpu_count']} cores, "
        f"Python {m['python']}, lmdb {m['lmdb']}; {report['total_s']:.1f}s"
    )
    if "workloads" in report:
        print(
            f"\nworkloads ({s['block_tokens']} tokens, {s['payload_bytes'] // 1024} KiB per "
            f"block; prefill assumed at {s['prefill_tokens_per_s']:.0f} tokens/s)"
        )
        print(
            f"  {'':<14}{'reqs':>6}{'req-hit':>9}{'tok-hit':>9}{'byte-hit':>9}"
            f"{'lookup p50/p99 us':>20}{'load p50/p99 us':>20}{'put p50/p99 us':>20}"
            f"{'req/s':>9}{'saved s':>9}"
        )
        for name, r in report["workloads"].items():
            st = r["stages_us"]
            stages = "".join(
                f"{st[k]['p50']:>11.0f}/{st[k]['p99']:<8.0f}" for k in ("lookup", "load", "put")
            )
            print(
                f"  {name:<14}{r['requests']:>6}{r['request_hit_rate']:>9.3f}"
                f"{r['token_hit_rate']:>9.3f}{r['byte_hit_rate']:>9.3f}{stages}"
                f"{_fmt(r['requests_per_s'], '.0f'):>9}{r['prefill']['saved_s']:>9.1f}"
            )
        for name, r in report["workloads"].items():
            buckets = "  ".join(
                f"{b['min_tokens']}-{b['max_tokens']}:{b['requests']}"
                for b in r["hit_histogram"]
                if b["requests"]
            )
            print(f"  {name} hit lengths (tokens:requests) {buckets}")
            if "phase_token_hit_rates" in r:
                rates = ", ".join(f"{x:.3f}" for x in r["phase_token_hit_rates"])
                print(
                    f"  {name} token hit rate by phase {rates} "
                    f"(capacity {r['daemon']['capacity_bytes']} bytes)"
                )
    if "ratios" in report:
        r = report["ratios"]
        print(
            f"\nratios ({r['settings']['bytes'] // MiB} MiB in {r['settings']['block_bytes'] // 1024}"
            f" KiB blocks, median of {r['settings']['repeat']})"
        )
        print(
            f"  load {r['load_gbps']:.2f} GB/s: {r['load_vs_memcpy']} x memcpy "
            f"({r['memcpy_gbps']:.2f}), {r['load_vs_file_read']} x file read "
            f"({r['file_read_gbps']:.2f})"
        )
        print(
            f"  put {r['put_gbps']:.2f} GB/s (durability full): {r['put_vs_file_write']} x "
            f"file write+fsync ({r['file_write_gbps']:.2f})"
        )
    if "peers" in report:
        pr = report["peers"]
        print(f"\npeers on {', '.join(pr['workloads'])}")
        mine = pr["prefixd"]
        print(
            f"  {'prefixd':<10} {mine['requests_per_s']:>9.0f} req/s  "
            f"load {mine['load_gbps']:.2f} GB/s  put {mine['put_gbps']:.2f} GB/s"
        )
        for peer in ("redis", "diskcache"):
            entry = pr[peer]
            if "skipped" in entry:
                print(f"  {peer:<10} skipped: {entry['skipped']}")
                continue
            t, x = entry["total"], entry["prefixd_ratio"]
            print(
                f"  {peer:<10} {t['requests_per_s']:>9.0f} req/s  load {t['load_gbps']:.2f} GB/s"
                f"  put {t['put_gbps']:.2f} GB/s  -> prefixd is {_fmt(x['requests_per_s'])}x "
                f"req/s, {_fmt(x['load_gbps'])}x load"
            )
    if "scale" in report:
        sc = report["scale"]
        small, large, x = sc["small"], sc["large"], sc["ratios_large_to_small"]
        print(
            f"\nscale: {large['entries']} entries (built in {large['build_s']:.1f}s) "
            f"vs {small['entries']}"
        )
        for label, a, b, key in (
            ("lookup p50 us", small["lookup_us"]["p50"], large["lookup_us"]["p50"], "lookup_p50"),
            ("lookup p99 us", small["lookup_us"]["p99"], large["lookup_us"]["p99"], "lookup_p99"),
            (
                "RSS after start MiB",
                small["memory_after_start"]["rss"] / MiB,
                large["memory_after_start"]["rss"] / MiB,
                "rss_after_start",
            ),
            (
                "RSS after lookups MiB",
                small["memory_after_lookups"]["rss"] / MiB,
                large["memory_after_lookups"]["rss"] / MiB,
                "rss_after_lookups",
            ),
            (
                "  of which anon MiB",
                small["memory_after_lookups"]["rss_anon"] / MiB,
                large["memory_after_lookups"]["rss_anon"] / MiB,
                "rss_anon_after_lookups",
            ),
            (
                "  of which file MiB",
                small["memory_after_lookups"]["rss_file"] / MiB,
                large["memory_after_lookups"]["rss_file"] / MiB,
                "rss_file_after_lookups",
            ),
            ("start s", small["start_s"], large["start_s"], "start_s"),
        ):
            verdict = "ok" if sc["within_factor"][key] else f"OVER {sc['max_factor']}x"
            print(f"  {label:<22}{a:>10.2f}{b:>10.2f}   x{_fmt(x[key])}  {verdict}")


def main(argv: Sequence[str] | None = None) -> int:
    return run_in_workdir(
        parse_args(argv), run, print_table, prefix="prefixd-suite-", with_sockets=False
    )


if __name__ == "__main__":
    raise SystemExit(main())
