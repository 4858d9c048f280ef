"""bench/run.py --quick --json: every section and key is there and every figure is sane.

No timing threshold anywhere: only shapes, ranges and what must hold whatever the machine's speed
(every backend sees the same hits on the unbounded traces; a shared prefix hits from the second
request on)."""

from __future__ import annotations

import importlib.util
import itertools
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench.benches import run_bench

ROOT = Path(__file__).resolve().parents[2]
RUN = ROOT / "bench" / "run.py"
WORKLOADS = ("shared_prefix", "chat", "rag", "drift")
PEER_WORKLOADS = ("shared_prefix", "chat", "rag")
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    return run_bench("run.py", "--quick", "--json", timeout_s=TIMEOUT_S)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def _rate(value: Any) -> bool:
    return isinstance(value, (int, float)) and 0.0 <= value <= 1.0


def test_top_level(report: dict[str, Any]) -> None:
    for key in ("settings", "workloads", "ratios", "peers", "scale", "machine", "total_s"):
        assert key in report, key
    assert report["mode"] == "quick"
    for key in ("cpu_model", "cpu_count", "python", "lmdb"):
        assert report["machine"][key], key
    assert _positive(report["settings"]["prefill_tokens_per_s"])
    assert set(report["section_s"]) == {"workloads", "peers", "ratios", "scale"}


@pytest.mark.parametrize("name", WORKLOADS)
def test_workload(report: dict[str, Any], name: str) -> None:
    r = report["workloads"][name]
    assert r["requests"] > 0
    assert 0 <= r["requests_hit"] <= r["requests"]
    assert 0 <= r["hit_tokens"] <= r["prompt_tokens"]
    for key in ("request_hit_rate", "token_hit_rate", "byte_hit_rate"):
        assert _rate(r[key]), (key, r[key])
    assert r["token_hit_rate"] > 0  # every trace repeats prefixes
    histogram = r["hit_histogram"]
    assert sum(b["requests"] for b in histogram) == r["requests"]
    assert histogram[0] == {
        "min_tokens": 0,
        "max_tokens": 0,
        "requests": r["requests"] - r["requests_hit"],
    }
    for low, high in itertools.pairwise(histogram):
        assert low["max_tokens"] < high["min_tokens"]
    stages = r["stages_us"]
    assert set(stages) == {"lookup", "load", "put"}
    assert stages["lookup"]["n"] == r["requests"]
    assert stages["load"]["n"] == r["requests_hit"]
    for stage in stages.values():
        assert stage["n"] > 0 and 0 < stage["p50"] <= stage["p99"]
    assert _positive(r["requests_per_s"]) and _positive(r["load_gbps"]) and _positive(r["put_gbps"])
    prefill = r["prefill"]
    expected = r["hit_tokens"] / report["settings"]["prefill_tokens_per_s"]
    assert prefill["saved_s"] == pytest.approx(expected, abs=1e-3)
    assert r["loaded_bytes"] > 0 and r["put_bytes"] > 0


def test_shared_prefix_hits_after_the_first_request(report: dict[str, Any]) -> None:
    r = report["workloads"]["shared_prefix"]
    assert r["requests_hit"] == r["requests"] - 1
    assert r["loads_shorter_than_lookup"] == 0


def test_drift_runs_under_a_capacity(report: dict[str, Any]) -> None:
    r = report["workloads"]["drift"]
    assert _positive(r["daemon"]["capacity_bytes"])
    rates = r["phase_token_hit_rates"]
    assert len(rates) == r["params"]["phases"] and all(_rate(x) for x in rates)
    for name in PEER_WORKLOADS:
        assert report["workloads"][name]["daemon"]["capacity_bytes"] is None


def test_ratios(report: dict[str, Any]) -> None:
    r = report["ratios"]
    for key in (
        "load_gbps",
        "memcpy_gbps",
        "file_read_gbps",
        "put_gbps",
        "file_write_gbps",
        "load_vs_memcpy",
        "load_vs_file_read",
        "put_vs_file_write",
    ):
        assert _positive(r[key]), key
    assert r["verified"] is True
    assert r["settings"]["daemon_durability"] == "full"


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


@pytest.mark.parametrize("peer", ["redis", "diskcache"])
def test_peer(report: dict[str, Any], peer: str) -> None:
    peers = report["peers"]
    assert peers["workloads"] == list(PEER_WORKLOADS)
    assert _positive(peers["prefixd"]["requests_per_s"])
    entry = peers[peer]
    available = _installed(peer) and (peer != "redis" or shutil.which("redis-server"))
    if not available:
        assert set(entry) == {"skipped"} and entry["skipped"]
        return
    assert "skipped" not in entry, entry.get("skipped")
    for name in PEER_WORKLOADS:
        w = entry["workloads"][name]
        assert w["same_hits_as_prefixd"] is True
        assert w["token_hit_rate"] == report["workloads"][name]["token_hit_rate"]
        assert _positive(w["requests_per_s"]) and _positive(w["load_gbps"])
        for value in w["prefixd_ratio"].values():
            assert _positive(value)
    for key in ("requests_per_s", "load_gbps", "put_gbps"):
        assert _positive(entry["total"][key])
        assert _positive(entry["prefixd_ratio"][key])


def test_scale(report: dict[str, Any]) -> None:
    s = report["scale"]
    assert s["small"]["entries"] == 1000
    assert s["large"]["entries"] == report["settings"]["scale_entries"]
    for size in ("small", "large"):
        store = s[size]
        assert _positive(store["build_s"]) and _positive(store["start_s"])
        assert 0 < store["lookup_us"]["p50"] <= store["lookup_us"]["p99"]
        for when in ("memory_after_start", "memory_after_lookups"):
            assert _positive(store[when]["rss"])
    for key in ("lookup_p50", "lookup_p99", "rss_after_start", "rss_after_lookups", "start_s"):
        assert _positive(s["ratios_large_to_small"][key]), key
        assert isinstance(s["within_factor"][key], bool)


def test_histogram_buckets() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from workloads import histogram, zipf_weights
    finally:
        sys.path.remove(str(ROOT / "bench"))
    buckets = histogram([0, 1, 2, 3, 4, 7, 8], max_blocks=8, block_tokens=16)
    assert [(b["min_tokens"], b["max_tokens"]) for b in buckets] == [
        (0, 0),
        (16, 16),
        (32, 48),
        (64, 112),
        (128, 240),
    ]
    assert [b["requests"] for b in buckets] == [1, 1, 2, 2, 1]
    weights = zipf_weights(10)
    assert weights.sum() == pytest.approx(1.0) and all(weights[:-1] > weights[1:])


def test_peers_need_workloads() -> None:
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--sections", "peers"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 2 and "peers" in done.stderr
