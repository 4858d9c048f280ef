"""The poison suite's SGLang rows (bench/poison_sglang.py), run as its users run it in the SGLang
venv: prefixd's HiCache backend serves the stored state or nothing in every scenario, and SGLang's
own file backend does what it does under the pinned sglang 0.5.23."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest

from tests.bench.benches import run_poison

if importlib.util.find_spec("sglang") is None:
    if os.environ.get("PREFIXD_REQUIRE_SGLANG") == "1":
        raise RuntimeError(
            "PREFIXD_REQUIRE_SGLANG=1 but sglang is not importable: run in .venv-sglang"
        )
    pytest.skip("sglang is not installed here (its venv: .ci/sglang-venv)", allow_module_level=True)

# scenario -> (prefixd, HiCacheFile)
EXPECTED = {
    "hybrid model (KV, window, Mamba state) after a restart": ("exact", "exact"),
    "hybrid model, a store torn before its last Mamba state, after a restart": ("exact", "exact"),
    # a Mamba pool's dtype is its conv states'; HiCacheFile reads the bytes into the new dtype
    "hybrid model, Mamba SSM state dtype changed across a restart (bf16 to fp16)": (
        "miss",
        "wrong",
    ),
    # the pools' pages have the same hashes: each pool's name tells their entries apart
    "two paged pools of one shape (KV and an indexer) after a restart": ("exact", "exact"),
    # HiCacheFile's file names carry the model name and ranks, not the weights
    "another engine's weights under the same model name, after a restart": ("miss", "wrong"),
    # prefixd verifies each page's checksum and serves the pages before it; HiCacheFile keeps none
    "a byte of a stored page flipped on disk (bit rot)": ("exact", "wrong"),
}


@pytest.fixture(scope="module")
def sglang_rows() -> dict[str, dict[str, Any]]:
    return {row["scenario"]: row for row in run_poison("poison_sglang.py")}


def test_prefixd_serves_the_stored_state_or_nothing(sglang_rows: dict[str, dict[str, Any]]) -> None:
    assert {name: row["prefixd"] for name, row in sglang_rows.items()} == {
        name: ours for name, (ours, _) in EXPECTED.items()
    }


def test_hicache_file_runs_the_same_scenarios(sglang_rows: dict[str, dict[str, Any]]) -> None:
    assert {name: (row["peer"], row["peer_storage"]) for name, row in sglang_rows.items()} == {
        name: (theirs, "SGLang HiCacheFile") for name, (_, theirs) in EXPECTED.items()
    }
