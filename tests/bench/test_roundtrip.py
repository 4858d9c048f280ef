"""bench/roundtrip.py --json, a few lookups: every figure is there and positive, the default
client's replies were all waited for (polled or slept for), and the pinned echo is measured
where there are two CPUs. No timing threshold."""

from __future__ import annotations

import os

from tests.bench.benches import positive, run_bench

LOOKUPS = 40
WARMUP = 200  # bench/roundtrip.py's own


def test_the_roundtrip_bench_reports_every_figure() -> None:
    report = run_bench("roundtrip.py", "--json", "--lookups", str(LOOKUPS), "--scale-entries", "0")
    for key in ("echo", "hello", "lookup", "lookup_sleeping"):
        assert positive(report[f"{key}_p50_us"]), key
        assert positive(report[f"{key}_p99_us"]), key
    waits = report["lookup_reply_waits"]
    # every lookup of the warm-up and the timed rounds, beside the greeting's replies
    assert waits["polled"] + waits["slept"] >= WARMUP + LOOKUPS
    pinned = report["echo_pinned"]
    if len(os.sched_getaffinity(0)) >= 2:
        assert positive(pinned["same_cpu_p50_us"]) and positive(pinned["cross_cpu_p50_us"])
    else:
        assert pinned is None
