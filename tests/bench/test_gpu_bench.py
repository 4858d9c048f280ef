"""bench/gpu_bench.py runs and reports what it promises (speed is shown by benchmarks, never
asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from numbers import Real
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
FIGURES = ("load_into_gbps", "e2e_gbps", "e2e_seconds", "store_from_gbps")
CPU_FIGURES = (*FIGURES, "memcpy_gbps", "put_gbps")
CUDA_FIGURES = (*FIGURES, "pinned_h2d_gbps")


def positive(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and value > 0


def test_quick_run_reports_every_figure_as_json() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.pop("NOTIFY_SOCKET", None)
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_bench.py"), "--quick", "--json"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)

    assert {"machine", "settings", "cpu", "cuda", "ratios", "seconds", "verified"} <= set(report)
    machine = report["machine"]
    assert {"cpu_model", "cpu_count", "torch", "cuda_device"} <= set(machine)
    assert machine["torch"] == torch.__version__
    assert report["settings"]["quick"] is True
    assert report["settings"]["size_mib"] == 32
    assert report["verified"] is True

    cpu = report["cpu"]
    for key in CPU_FIGURES:
        assert positive(cpu[key]), (key, cpu)
    ratios = report["ratios"]
    assert positive(ratios["load_into_vs_memcpy"]), ratios
    assert positive(ratios["store_from_vs_put"]), ratios

    if torch.cuda.is_available():
        cuda = report["cuda"]
        assert machine["cuda_device"], machine
        for key in CUDA_FIGURES:
            assert positive(cuda[key]), (key, cuda)
        assert positive(ratios["load_into_vs_pinned_h2d"]), ratios
        assert isinstance(report["targets"]["meets_load_into_vs_pinned_h2d"], bool)
    else:
        assert report["cuda"] is None
        assert machine["cuda_device"] is None
        assert "load_into_vs_pinned_h2d" not in ratios
    # every timed measure kept its repetitions
    assert all(len(s) == report["settings"]["repeat"] for s in report["seconds"].values())
