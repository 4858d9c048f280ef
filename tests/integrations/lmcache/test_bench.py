"""bench/lmcache_adapter.py as its users run it: both adapters on the same objects, beside the
limits of the same bytes, and nothing of its gigabytes left on disk after it."""

from __future__ import annotations

import os
from pathlib import Path

from ...bench.benches import run_bench


def test_the_adapter_bench_reports_the_read_limits_and_leaves_no_files(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    report = run_bench(
        "lmcache_adapter.py",
        *("--objects", "4", "--object-mib", "1", "--repeat", "1", "--json"),
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    # a plain read from the page cache (the fs adapter's path) and one that takes the crc32c as
    # it reads (the daemon's), into touched page-aligned memory
    assert report["read_gbps"] > 0
    assert report["read_checksum_gbps"] > 0
    fs, ours = report["results"]
    assert (fs["adapter"], ours["adapter"]) == ("lmcache fs", "prefixd")
    assert fs["loads_exact"] and ours["loads_exact"]
    assert ours["after_damage"]["served_wrong_bytes"] == 0
    assert list(scratch.iterdir()) == []  # the stores of both adapters went with the run
