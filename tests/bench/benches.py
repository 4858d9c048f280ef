"""Running a bench as its users do: `python bench/<script> ... --json` in a subprocess from the
repository root, its one JSON report parsed (a failure shows the bench's own error output)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(
    script: str, *args: str, timeout_s: float = 300, env: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The JSON report of `bench/<script>` run with `args` (which should include --json), in
    `env` when given."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def run_poison(script: str, *, timeout_s: float = 300) -> list[dict[str, Any]]:
    """The rows of a poison-suite module (`bench/poison_<engine>.py --json`: its last line of
    output; engines log on stdout too)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--json"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    rows: list[dict[str, Any]] = json.loads(done.stdout.splitlines()[-1])
    return rows


def positive(value: Any) -> bool:
    """A finite number above zero (what every measured figure must be, whatever the machine)."""
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0
