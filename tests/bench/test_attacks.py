"""bench/attacks.py --json: each attack is reported with what the attacker was told and how the
honest client beside it fared. No timing threshold: only what must hold on any machine (the
honest client is answered without an error; the attacks are refused as docs/security.md says)."""

from __future__ import annotations

from tests.bench.benches import run_bench


def test_the_attacks_bench_reports_each_attack_beside_an_honest_client() -> None:
    report = run_bench("attacks.py", "--only", "decode,verify,spans,replies", "--json")
    assert set(report) == {"decode", "verify", "spans", "replies", "machine"}
    for name in ("decode", "verify", "spans", "replies"):
        row = report[name]
        assert "timed_out" not in row, row
        assert row["honest"]["errors"] == 0 and row["honest"]["answered"] > 0, row
        assert row["peak_rss_growth_mib"] >= 0
    assert report["decode"]["told"] == {"bad_request": 12, "ok": 12}
    verify = report["verify"]["told"]
    assert verify.get("ok", 0) >= 1 and set(verify) <= {"ok", "busy"}
    assert sum(verify.values()) == 64
    assert report["spans"]["told"] == {"bad_region": 1} and report["spans"]["stored_mib"] == 0
    assert report["replies"]["told"] == {"bad_tokens": 1}
