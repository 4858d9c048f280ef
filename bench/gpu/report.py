"""The one JSON object of bench/gpu/run.sh, from what its steps left in its work directory: each
step's exit status and seconds, the CUDA tests' counts, the benchmarks' own JSON (or the end of
their output where they failed), and what ran: Python, torch, the device, the prefixd tested.

    python report.py WORK STARTED INSTALLED(0|1) QUICK(0|1)

Exits 1 unless every step succeeded; with $OUT set, writes the JSON and the steps' output there.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

TAIL_CHARS = 3000
NOTHING_COLLECTED = 5  # pytest's exit status when no test was selected


def step(work: Path, name: str) -> dict[str, Any] | None:
    path = work / f"{name}.status"
    if not path.exists():
        return None
    rc, began, ended = path.read_text().split()
    seconds = round(float(ended) - float(began), 1)
    return {"rc": int(rc), "seconds": seconds, "timed_out": rc in ("124", "137")}


def tail(work: Path, name: str) -> str:
    return "".join(
        (work / f"{name}.{kind}").read_text(errors="replace")
        for kind in ("out", "log")
        if (work / f"{name}.{kind}").exists()
    )[-TAIL_CHARS:]


def bench(work: Path, name: str) -> dict[str, Any] | None:
    got = step(work, name)
    if got is None:
        return None
    try:
        got["report"] = json.loads((work / f"{name}.out").read_text())
    except ValueError:
        got["tail"] = tail(work, name)
    return got


def cuda_tests(work: Path) -> dict[str, Any] | None:
    got = step(work, "cuda_tests")
    if got is None:
        return None
    xml = work / "cuda_tests.xml"
    if xml.exists():
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is not None:
            counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
            ran = counts["tests"] - counts["skipped"]
            got.update(counts, passed=ran - counts["failures"] - counts["errors"])
            got["modules"] = sorted({case.get("classname", "") for case in suite.iter("testcase")})
    if got["rc"] not in (0, NOTHING_COLLECTED):
        got["tail"] = tail(work, "cuda_tests")
    return got


def what_ran(installed_here: bool, quick: bool) -> dict[str, Any]:
    kit: dict[str, Any] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "installed_here": installed_here,
        "quick": quick,
    }
    try:
        from importlib.metadata import version

        import prefixd

        kit["prefixd"] = version("prefixd")
        kit["prefixd_from"] = str(Path(prefixd.__file__).parent)
    except ImportError as error:
        kit["prefixd"] = f"not importable: {error}"
    try:
        import torch

        cuda = torch.cuda.is_available()
        kit.update(
            torch=torch.__version__,
            cuda=cuda,
            device=torch.cuda.get_device_name(0) if cuda else "cpu",
        )
    except ImportError as error:
        kit["torch"] = f"not importable: {error}"
    return kit


def main() -> int:
    work, started = Path(sys.argv[1]), float(sys.argv[2])
    installed_here, quick = sys.argv[3] == "1", sys.argv[4] == "1"
    report: dict[str, Any] = {"kit": what_ran(installed_here, quick)}
    steps = {
        "install": step(work, "install"),
        "cuda_tests": cuda_tests(work),
        "gpu_bench": bench(work, "gpu_bench"),
        "limits": bench(work, "limits"),
    }
    if steps["install"] is not None and steps["install"]["rc"]:
        steps["install"]["tail"] = tail(work, "install")
    report.update({name: got for name, got in steps.items() if got is not None})
    report["seconds"] = round(time.time() - started, 1)
    report["ok"] = all(
        got is not None and got["rc"] in (0, NOTHING_COLLECTED if name == "cuda_tests" else 0)
        for name, got in steps.items()
        if name != "install" or installed_here
    ) and all("report" in (steps[name] or {}) for name in ("gpu_bench", "limits"))
    text = json.dumps(report, indent=1)
    print(text)
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu-kit.json").write_text(text + "\n")
        for name in ("install", "cuda_tests", "gpu_bench", "limits"):
            kept = tail(work, name) if name != "gpu_bench" else ""
            if kept:
                Path(out, f"{name}.log").write_text(kept)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
