"""A/B of `bench/daemon_bench.py`: another revision (its client and its daemon) against this tree,
run alternately in one session so machine noise falls on both alike.

The other revision is checked out into a temporary git worktree and run with it first on
PYTHONPATH (its `python -m prefixd serve` too); each side runs `--rounds` times, alternating, and
the medians of the chosen figures are printed with their ratio (this tree over the other).

    python bench/ab.py a8680af --rounds 5
    python bench/ab.py HEAD~1 --rounds 3 -- --size-mib 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

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
)


def run(tree: Path, extra: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(tree / "bench" / "daemon_bench.py"), "--json", *extra]
    out = subprocess.run(command, cwd=tree, env=env, check=True, capture_output=True, text=True)
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revision", help="the other side: any git revision")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("extra", nargs="*", help="arguments for daemon_bench.py (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefixd-ab-") as scratch:
        other = Path(scratch) / "other"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(other), args.revision],
            check=True,
        )
        try:
            runs: dict[str, list[dict[str, float]]] = {"other": [], "this": []}
            for _ in range(args.rounds):
                runs["other"].append(run(other, args.extra))
                runs["this"].append(run(REPO, args.extra))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(other)])
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
