"""bench/encode_pool.py --json, a few small puts: both rules are timed and reported, and the rule
reported is the store's. No timing threshold."""

from __future__ import annotations

from prefixd.store.codec import POOL_MIN_RAW_BYTES
from tests.bench.benches import positive, run_bench


def test_the_encode_pool_bench_times_both_rules() -> None:
    args = ["--json", "--blocks", "4", "--block-kib", "16", "--puts", "3", "--rounds", "2"]
    report = run_bench("encode_pool.py", *args)
    assert set(report["blocks_per_s"]) == {"rule", "always_pool"}
    assert all(positive(rate) for rate in report["blocks_per_s"].values())
    assert positive(report["inline_vs_pool"])
    assert report["rule_hands_over"] is False  # 64 KiB of raw payloads stay in the put's thread
    assert report["settings"]["pool_min_raw_bytes"] == POOL_MIN_RAW_BYTES
