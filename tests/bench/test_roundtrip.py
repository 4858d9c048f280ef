"""bench/roundtrip.py --json, a few lookups: every figure is there and positive, the default
client's replies were all waited for (polled or slept for), and the pinned echo is measured
where there are two CPUs. No timing threshold."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ROUNDTRIP = ROOT / "bench" / "roundtrip.py"
LOOKUPS = 40
WARMUP = 200  # bench/roundtrip.py's own


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_the_roundtrip_bench_reports_every_figure() -> None:
    args = ["--json", "--lookups", str(LOOKUPS), "--scale-entries", "0"]
    done = subprocess.run(
        [sys.executable, str(ROUNDTRIP), *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    for key in ("echo", "hello", "lookup", "lookup_sleeping"):
        assert _positive(report[f"{key}_p50_us"]), key
        assert _positive(report[f"{key}_p99_us"]), key
    waits = report["lookup_reply_waits"]
    # every lookup of the warm-up and the timed rounds, beside the greeting's replies
    assert waits["polled"] + waits["slept"] >= WARMUP + LOOKUPS
    pinned = report["echo_pinned"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert _positive(pinned["same_cpu_p50_us"]) and _positive(pinned["cross_cpu_p50_us"])
    else:
        assert pinned is None
