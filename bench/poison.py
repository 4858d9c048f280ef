"""The poison suite's table: every silent-wrong-KV failure the peers have had, replayed through
prefixd and through the peer's own storage where it runs here.

Run from the repository root once the engines' venvs are built (.ci/vllm-venv, .ci/lmcache-venv,
.ci/sglang-venv):

    .venv/bin/python bench/poison.py [--json]

Each scenario module runs in its engine's venv (a module whose venv is missing is an error, not a
skipped row) and prints its rows; this prints them as one table: scenario | reported in | prefixd |
the peer's storage (exact / miss / wrong: another state served without an error).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from poisonlib import Row, print_rows

# module: the venv it runs in
MODULES = {
    "poison_mm": ".venv",
    "poison_vllm": ".venv-vllm",
    "poison_ranks": ".venv-vllm",
    "poison_lmcache": ".venv-vllm",
    "poison_sglang": ".venv-sglang",
}


def run_module(module: str, venv: str) -> list[Row]:
    python = REPO / venv / "bin" / "python"
    script = REPO / "bench" / f"{module}.py"
    if not python.exists():
        raise SystemExit(f"{module} runs in {venv}, which is not built (see .ci/run)")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    done = subprocess.run(
        [str(python), "-W", "ignore::DeprecationWarning", str(script), "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{module} failed:\n{done.stderr[-4000:]}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("[")]
    return [Row(**row) for row in json.loads(lines[-1])]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", nargs="*", choices=sorted(MODULES), help="these modules alone")
    args = parser.parse_args(argv)
    chosen = args.only or list(MODULES)
    rows = [row for module in chosen for row in run_module(module, MODULES[module])]
    print_rows(rows, args.json)


if __name__ == "__main__":
    main()
