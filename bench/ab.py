"""A/B of `bench/daemon_bench.py`: another revision (its client and its daemon) against this tree,
run alternately in one session so machine noise falls on both alike.

The other revision is checked out into a temporary git worktree and run with it first on
PYTHONPATH (its `python -m prefixd serve` too); each side runs `--rounds` times, alternating, and
the medians of the chosen figures are printed with their ratio (this tree over the other).

    python bench/ab.py a8680af --rounds 5
    python bench/ab.py HEAD~1 --rounds 3 -- --size-mib 256

With `--clients`, only the clients differ: one daemon of this tree serves a `bench/lookup_worker.py`
of each side (the other side's `prefixd` first on its PYTHONPATH), and the two take turns in
chunks of `--chunk` lookups of daemon_bench's 131072-token prompt until each has made `--lookups`.
Both see the same daemon, the same store and the same moments' noise, so the ratio of their p50s is
what the client itself adds or saves, to within a percent or so.

    python bench/ab.py a8680af --clients --lookups 20000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
FIGURES = (
    "load_vs_memcpy",
    "load_gbps",
    "memcpy_gbps",
    "lookup_p50_us",
    "lookup_p99_us",
    "lookup_hashed_p50_us",
    "health_p50_us",
    "hello_p50_us",
    "load_block_p50_us",
)


def run(tree: Path, extra: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(tree / "bench" / "daemon_bench.py"), "--json", *extra]
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def worker(tree: Path, sock: Path, tokens: Path, n_blocks: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "lookup_worker.py"), str(sock), str(tokens)]
        + [str(n_blocks)],
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    found = json.loads(process.stdout.readline())["prefixd"]
    if not Path(found).is_relative_to(tree):
        raise RuntimeError(f"the worker for {tree} imported prefixd from {found}")
    return process


def ask(process: subprocess.Popen[str], count: int) -> list[float]:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(f"{count}\n")
    process.stdin.flush()
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"a lookup worker exited with {process.wait()}")
    times: list[float] = json.loads(line)
    return times


def percentiles(times: list[float]) -> dict[str, float]:
    cuts = statistics.quantiles(times, n=100)
    return {"p50": round(statistics.median(times), 1), "p99": round(cuts[98], 1)}


def compare_clients(other: Path, scratch: Path, lookups: int, chunk: int) -> dict[str, Any]:
    """One daemon of this tree; the two sides' clients take turns looking up the same prompt."""
    sys.path.insert(0, str(REPO / "bench"))
    import numpy as np
    from benchlib import bench_identity
    from daemon_bench import (
        LOOKUP_BLOCK_TOKENS,
        LOOKUP_PAYLOAD_BYTES,
        LOOKUP_PROMPT_TOKENS,
        SEED,
        Daemon,
        lookup_payloads,
        make_tokens,
        parse_args,
        put_all,
    )

    from prefixd.client import Client

    rng = np.random.default_rng(SEED)
    tokens = make_tokens(LOOKUP_PROMPT_TOKENS, rng)
    n_blocks = LOOKUP_PROMPT_TOKENS // LOOKUP_BLOCK_TOKENS
    ident = bench_identity(LOOKUP_BLOCK_TOKENS, LOOKUP_PAYLOAD_BYTES)
    tokens_path = scratch / "tokens.npy"
    np.save(tokens_path, tokens)
    sock_dir = Path(tempfile.mkdtemp(prefix="pxd-"))
    daemon = Daemon(scratch / "data", sock_dir, parse_args(["--size-mib", "1", "--block-kib", "1"]))
    times: dict[str, list[float]] = {"other": [], "this": []}
    turns: list[float] = []  # each turn's ratio of the two sides' chunk medians
    try:
        daemon.start()
        with Client(daemon.socket, region_bytes=n_blocks * LOOKUP_PAYLOAD_BYTES) as client:
            put_all(client, ident, tokens, lookup_payloads(n_blocks, rng), 64)
        sides = {"other": worker(other, daemon.socket, tokens_path, n_blocks)}
        sides["this"] = worker(REPO, daemon.socket, tokens_path, n_blocks)
        try:
            for process in sides.values():
                ask(process, 200)  # warm-up
            turn = 0
            while len(times["this"]) < lookups:
                order = ["other", "this"] if turn % 2 == 0 else ["this", "other"]
                chunks = {}
                for name in order:
                    chunks[name] = ask(sides[name], min(chunk, lookups - len(times[name])))
                    times[name] += chunks[name]
                turns.append(statistics.median(chunks["this"]) / statistics.median(chunks["other"]))
                turn += 1
        finally:
            for process in sides.values():
                assert process.stdin is not None
                process.stdin.close()
                process.wait()
    finally:
        daemon.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)
    figures = {name: percentiles(values) for name, values in times.items()}
    return {
        "lookups": lookups,
        "chunk": chunk,
        **figures,
        "p50_this_over_other": round(figures["this"]["p50"] / figures["other"]["p50"], 3),
        "p99_this_over_other": round(figures["this"]["p99"] / figures["other"]["p99"], 3),
        "turns": len(turns),
        "median_turn_p50_ratio": round(statistics.median(turns), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the other side: any git revision")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", action="store_true", help="one daemon, the two clients")
    parser.add_argument("--lookups", type=int, default=20000, help="with --clients: per side")
    parser.add_argument("--chunk", type=int, default=100, help="with --clients: lookups per turn")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.extra = argv[cut + 1 :]  # arguments for daemon_bench.py, after --
    with tempfile.TemporaryDirectory(prefix="prefixd-ab-") as scratch:
        other = Path(scratch) / "other"
        subprocess.run(
            [
                "git",
                "-C",
                str(REPO),
                "worktree",
                "add",
                "-q",
                "--detach",
                str(other),
                args.revision,
            ],
            check=True,
        )
        try:
            if args.clients:
                report = compare_clients(other, Path(scratch), args.lookups, args.chunk)
                print(json.dumps({"revision": args.revision, **report}, indent=1))
                return 0
            runs: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
            for _ in range(args.rounds):
                runs["other"].append(run(other, args.extra))
                runs["this"].append(run(REPO, args.extra))
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)],
                check=False,
            )
    report = {"revision": args.revision, "rounds": args.rounds, "figures": {}}
    for name in FIGURES:
        other_values = [r[name] for r in runs["other"]]
        this_values = [r[name] for r in runs["this"]]
        before, after = statistics.median(other_values), statistics.median(this_values)
        report["figures"][name] = {  # type: ignore[index]
            "other": other_values,
            "this": this_values,
            "other_median": before,
            "this_median": after,
            "this_over_other": round(after / before, 3),
        }
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
