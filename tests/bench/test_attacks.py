"""bench/attacks.py --json: each attack is reported with what the attacker was told and how the
honest client beside it fared. No timing threshold: only what must hold on any machine (the
honest client is answered without an error; the attacks are refused as the README says)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300


def test_the_attacks_bench_reports_each_attack_beside_an_honest_client() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "attacks.py"), "--only", "decode,verify", "--json"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert set(report) == {"decode", "verify", "machine"}
    for name in ("decode", "verify"):
        row = report[name]
        assert "timed_out" not in row, row
        assert row["honest"]["errors"] == 0 and row["honest"]["answered"] > 0, row
        assert row["peak_rss_growth_mib"] >= 0
    assert report["decode"]["told"] == {"bad_request": 12, "ok": 12}
    verify = report["verify"]["told"]
    assert verify.get("ok", 0) >= 1 and set(verify) <= {"ok", "busy"}
    assert sum(verify.values()) == 64
