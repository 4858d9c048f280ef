"""bench/gpu/run.sh, the one command a GPU machine runs: it runs every step on the CPU too, reports
each in one JSON object, and says so when a step failed (speed is shown by the figures it prints,
never asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from ..conftest import NESTED_SUITE

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "bench" / "gpu"
TIMEOUT_S = 300
STEPS = ("cuda_tests", "gpu_bench", "limits")


def run_kit(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    env.pop("NOTIFY_SOCKET", None)
    env.pop("OUT", None)
    env["PYTHON"] = sys.executable
    env[NESTED_SUITE] = "1"  # its CUDA tests run a suite inside this one: this one watches
    return subprocess.run(
        ["bash", str(KIT / "run.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )


def test_a_quick_run_reports_every_step_in_one_json() -> None:
    done = run_kit("--installed", "--quick")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["ok"] is True
    assert "install" not in report  # --installed: nothing was installed
    for name in STEPS:
        assert report[name]["rc"] == 0 and not report[name]["timed_out"], report[name]
    import torch

    kit = report["kit"]
    assert kit["cuda"] is torch.cuda.is_available() and kit["torch"] == torch.__version__
    tests = report["cuda_tests"]
    assert tests["tests"] >= 3 and tests["failures"] == tests["errors"] == 0
    if not torch.cuda.is_available():
        assert tests["skipped"] == tests["tests"]  # the CUDA tests, collected and skipped
    # the vLLM spec's device copies, which need no vLLM; not the engines' own tests
    assert "tests.integrations.test_vllm_copies" in tests["modules"]
    assert not [m for m in tests["modules"] if m.startswith("tests.integrations.vllm")]
    bench = report["gpu_bench"]["report"]
    assert bench["verified"] is True and bench["settings"]["quick"] is True
    assert (bench["cuda"] is None) is (not torch.cuda.is_available())
    rows = report["limits"]["report"]["rows"]
    assert set(rows) == {"put_roots", "put_64", "durable_put", "lookup", "load_clients"}


def test_a_misspelt_flag_is_refused_before_anything_runs() -> None:
    done = run_kit("--quik")
    assert done.returncode == 2
    assert "unknown argument --quik" in done.stderr and done.stdout == ""


def write_step(work: Path, name: str, rc: int, out: str, log: str = "") -> None:
    (work / f"{name}.status").write_text(f"{rc} 100.0 102.5\n")
    (work / f"{name}.out").write_text(out)
    (work / f"{name}.log").write_text(log)


def report_of(work: Path, *, installed_here: bool) -> tuple[int, dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, str(KIT / "report.py"), str(work), "99.0", str(int(installed_here)), "0"],
        env={k: v for k, v in os.environ.items() if k != "OUT"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done.returncode, json.loads(done.stdout)


def test_a_failed_step_is_reported_with_its_output_and_fails_the_run(tmp_path: Path) -> None:
    write_step(tmp_path, "install", 0, "installed")
    write_step(tmp_path, "cuda_tests", 0, "3 passed")
    write_step(tmp_path, "gpu_bench", 1, "", "Traceback: the daemon did not start")
    write_step(tmp_path, "limits", 124, '{"rows": {}}')
    rc, report = report_of(tmp_path, installed_here=True)
    assert rc == 1 and report["ok"] is False
    assert report["install"] == {"rc": 0, "seconds": 2.5, "timed_out": False}
    assert "the daemon did not start" in report["gpu_bench"]["tail"]
    assert "report" not in report["gpu_bench"]
    assert report["limits"]["timed_out"] is True  # its figures are there, its time ran out
    assert report["limits"]["report"] == {"rows": {}}


def test_a_failed_install_fails_the_run(tmp_path: Path) -> None:
    write_step(tmp_path, "install", 1, "", "ERROR: No matching distribution found for lmdb")
    for name in STEPS:
        write_step(tmp_path, name, 0, "{}")
    rc, report = report_of(tmp_path, installed_here=True)
    assert rc == 1 and report["ok"] is False
    assert "No matching distribution" in report["install"]["tail"]
