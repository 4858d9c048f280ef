"""bench/limits.py --quick --json: every row is there with its measure, limit, ratio and targets,
every figure a positive number. No timing threshold: only what holds whatever the machine's
speed (a fresh region is faulted in by the daemon's first load; a cold round began cold)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
LIMITS = ROOT / "bench" / "limits.py"
ROWS = (
    "put_chain",
    "put_roots",
    "put_64",
    "first_load",
    "durable_put",
    "lookup",
    "lookup_scale",
    "load_clients",
    "cold_load",
)
TIMEOUT_S = 300


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(LIMITS), "--quick", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    done = _run("--json")
    assert done.returncode == 0, done.stderr[-4000:]
    parsed: dict[str, Any] = json.loads(done.stdout)
    return parsed


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def test_every_row_is_reported(report: dict[str, Any]) -> None:
    assert report["mode"] == "quick"
    assert tuple(report["rows"]) == ROWS
    assert set(report["row_s"]) == set(ROWS)
    reported = report["row_reported_to_host_mib"]
    assert set(reported) == set(ROWS)
    expected = Path("/sys/module/page_reporting/parameters/reported_kib").exists()
    for value in reported.values():
        assert (isinstance(value, int) and value >= 0) if expected else value is None, value
    for key in ("cpu_model", "cpu_count", "python", "lmdb"):
        assert report["machine"][key], key


@pytest.mark.parametrize("name", ROWS)
def test_a_row_holds_positive_figures(report: dict[str, Any], name: str) -> None:
    r = report["rows"][name]
    assert r["unit"]
    for part in ("measure", "limit", "ratio"):
        assert r[part], part
        for key, value in r[part].items():
            assert _positive(value), (part, key, value)
    for target in r["targets"]:
        part, _, key = target["what"].partition(".")
        assert target["value"] == r[part][key]
        assert target["op"] in (">=", "<=") and _positive(target["bound"])
        assert isinstance(target["met"], bool)
        held = (
            target["value"] >= target["bound"]
            if target["op"] == ">="
            else (target["value"] <= target["bound"])
        )
        assert target["met"] is held
    missed = {m for m in report["targets_missed"] if m.startswith(f"{name}: ")}
    assert len(missed) == sum(not t["met"] for t in r["targets"])


def test_each_row_carries_the_issues_targets(report: dict[str, Any]) -> None:
    wanted = {
        "put_roots": {("ratio.daemon", ">=", 0.5)},
        "put_64": {("ratio.daemon", ">=", 0.6)},
        "first_load": {("ratio.first_vs_second", ">=", 0.9)},
        "durable_put": {("ratio.full", ">=", 0.8), ("ratio.periodic", ">=", 0.8)},
        "lookup": {("measure.p50_us", "<=", 120.0), ("measure.p99_us", "<=", 1000.0)},
        "lookup_scale": {("ratio.p50", "<=", 1.2)},
        "load_clients": {("ratio.4_clients", ">=", 0.5)},  # --quick runs 1 and 4 processes
        "cold_load": {("ratio.page_cache", ">=", 0.8), ("ratio.cold", ">=", 0.9)},
    }
    for name, targets in wanted.items():
        got = {(t["what"], t["op"], t["bound"]) for t in report["rows"][name]["targets"]}
        assert got == targets, name


def test_the_rows_details(report: dict[str, Any]) -> None:
    rows = report["rows"]
    waits = rows["put_roots"]["library_put_us"]  # a put back to back, and after a wait
    assert set(waits) == {"back_to_back", "after_a_wait"}
    assert all(_positive(v) for v in waits.values())
    slope = rows["put_chain"]["slope_us_per_block"]
    assert set(slope) == {"library", "raw_lmdb"} and all(math.isfinite(v) for v in slope.values())
    faults = rows["first_load"]["daemon_minor_faults"]
    # counted for both loads; since the daemon maps a region in at attach, the first takes about
    # none, and never one per page of the region
    assert all(isinstance(faults[k], int) and faults[k] >= 0 for k in ("first", "second"))
    assert faults["first"] < rows["first_load"]["region_pages"]
    clients = rows["load_clients"]["settings"]["clients"]
    assert set(rows["load_clients"]["ratio"]) == {f"{c}_clients" for c in clients}
    cold = rows["cold_load"]
    assert cold["cold_method"] == "fadvise_dontneed" and cold["drop_caches_skipped"]
    assert all(f < 0.5 for f in cold["resident_before_cold"]["plain_file"])
    assert rows["lookup_scale"]["entries"]["small"] == 1000


def test_only_runs_the_rows_named() -> None:
    done = _run("--only", "lookup", "--json")
    assert done.returncode == 0, done.stderr[-4000:]
    assert list(json.loads(done.stdout)["rows"]) == ["lookup"]
    refused = _run("--only", "lookup,nonsense")
    assert refused.returncode == 2 and "nonsense" in refused.stderr
