"""bench/load_phases.py --json on a small chain: every phase and floor is there and positive, and
the phases fit inside the load they were timed in. No timing threshold."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LOAD_PHASES = ROOT / "bench" / "load_phases.py"


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_the_load_phases_bench_reports_every_phase_and_floor() -> None:
    args = ["--json", "--blocks", "4", "--block-kib", "1024", "--loads", "3"]
    done = subprocess.run(
        [sys.executable, str(LOAD_PHASES), *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    phases = report["phases_ms"]
    parts = ("walk", "gather", "read_ahead", "copy_verify")
    for name in (*parts, "total"):
        assert _positive(phases[name]), name
    # medians of nested timers: the parts of a load cannot add up to much more than the load
    assert sum(phases[name] for name in parts) <= phases["total"] * 1.5
    assert _positive(report["load_gbps"])
    for name in ("preadv_crc_1_thread", "preadv_crc_2_threads", "memcpy_1_thread"):
        assert _positive(report["floors_gbps"][name]), name
