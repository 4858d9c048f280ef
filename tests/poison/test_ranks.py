"""Poison suite, LMCache#5344: a multi-rank store that failed on one rank leaves a partial entry
(bench/poison_ranks.py). prefixd's LMCache adapter serves none of the torn chunk on any rank; LMCache's
own fs_native L2 adapter, under the pinned lmcache 0.5.6, reports the stored rank's part as a hit
and serves it: a partial chunk.

Runs in the vLLM venv with lmcache added (.ci/lmcache-venv), where PREFIXD_REQUIRE_LMCACHE=1 makes
a missing lmcache a failure; the core venv has no lmcache, so there the module is skipped."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

if importlib.util.find_spec("lmcache") is None:
    if os.environ.get("PREFIXD_REQUIRE_LMCACHE") == "1":
        raise RuntimeError(
            "PREFIXD_REQUIRE_LMCACHE=1 but lmcache is not importable: run in .venv-vllm"
        )
    pytest.skip("lmcache is not installed (the vLLM venv has it)", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]


def test_a_torn_multi_rank_entry_is_a_miss_for_prefixd_and_partial_for_lmcache(
    tmp_path: Path,
) -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import poison_ranks
        from poisonlib import SAFE
    finally:
        sys.path.remove(str(ROOT / "bench"))
    [row] = poison_ranks.rows(tmp_path)
    assert row.where == "LMCache#5344"
    assert row.prefixd in SAFE
    assert row.prefixd == "miss"  # no rank is served any part of the torn chunk
    assert row.peer == "wrong", row  # measured under lmcache 0.5.6: one rank's part served
    assert row.peer_storage.startswith("LMCache 0.5.6")
