"""bench/encode_pool.py --json, a few small puts: both rules are timed and reported, and the rule
reported is the store's. No timing threshold."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prefixd.store.codec import POOL_MIN_RAW_BYTES

ROOT = Path(__file__).resolve().parents[2]


def test_the_encode_pool_bench_times_both_rules() -> None:
    args = ["--json", "--blocks", "4", "--block-kib", "16", "--puts", "3", "--rounds", "2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "encode_pool.py"), *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert set(report["blocks_per_s"]) == {"rule", "always_pool"}
    assert all(rate > 0 for rate in report["blocks_per_s"].values())
    assert report["inline_vs_pool"] > 0
    assert report["rule_hands_over"] is False  # 64 KiB of raw payloads stay in the put's thread
    assert report["settings"]["pool_min_raw_bytes"] == POOL_MIN_RAW_BYTES
