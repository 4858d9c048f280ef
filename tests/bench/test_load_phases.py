"""bench/load_phases.py --json on a small chain: every phase and floor is there and positive, and
the phases fit inside the load they were timed in. No timing threshold."""

from __future__ import annotations

from tests.bench.benches import positive, run_bench


def test_the_load_phases_bench_reports_every_phase_and_floor() -> None:
    report = run_bench(
        "load_phases.py", "--json", "--blocks", "4", "--block-kib", "1024", "--loads", "3"
    )
    phases = report["phases_ms"]
    parts = ("walk", "gather", "read_ahead", "copy_verify")
    for name in (*parts, "total"):
        assert positive(phases[name]), name
    # medians of nested timers: the parts of a load cannot add up to much more than the load
    assert sum(phases[name] for name in parts) <= phases["total"] * 1.5
    assert positive(report["load_gbps"])
    for name in ("preadv_crc_1_thread", "preadv_crc_2_threads", "memcpy_1_thread"):
        assert positive(report["floors_gbps"][name]), name
