"""The poison suite's LMCache rows (bench/poison_lmcache.py), run as its users run it in the vLLM
venv with lmcache added: prefixd's L2 adapter serves the stored KV or nothing in every scenario,
and LMCache's own fs L2 adapter and local_disk backend do what they do under lmcache 0.5.6."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.bench.benches import run_poison

if importlib.util.find_spec("lmcache") is None:
    if os.environ.get("PREFIXD_REQUIRE_LMCACHE") == "1":
        raise RuntimeError(
            "PREFIXD_REQUIRE_LMCACHE=1 but lmcache is not importable: run in .venv-vllm"
        )
    pytest.skip(
        "lmcache is not installed here (its venv: .ci/lmcache-venv)", allow_module_level=True
    )

WEIGHTS = "another engine's weights under the same model name, after a restart"
SALTS = "one chunk hash under two cache salts, live and after a restart"
DTYPE = "KV dtype changed across a restart (bfloat16 to float16), same weights"
ROT = "a byte of a stored chunk flipped on disk (bit rot)"
FS, DISK = "LMCache fs L2 adapter", "LMCache local_disk backend"
# (scenario, the peer's storage) -> (prefixd, the peer's storage)
EXPECTED = {
    # neither LMCache's ObjectKey nor its file names say which weights made a chunk
    (WEIGHTS, FS): ("miss", "wrong"),
    # local_disk's index lives in memory: nothing on its disk is found after a restart
    (WEIGHTS, DISK): ("miss", "miss"),
    # the fs adapter puts the cache salt in its file names
    (SALTS, FS): ("exact", "exact"),
    # LMCache's vLLM connector keys a chunk by request configs, not by the request's cache salt
    (SALTS, DISK): ("exact", "wrong"),
    # LMCache's ObjectKey does not say the dtype, and its fs adapter stores bytes by key; prefixd
    # names each object with its layout (dtype and shape), so each dtype reads its own bytes
    (DTYPE, FS): ("exact", "wrong"),
    # local_disk keys by dtype, but nothing on its disk is found after a restart
    (DTYPE, DISK): ("exact", "miss"),
    # prefixd verifies each chunk's checksum and serves the others; LMCache keeps none
    (ROT, FS): ("exact", "wrong"),
    (ROT, DISK): ("exact", "wrong"),
}


@pytest.fixture(scope="module")
def lmcache_outcomes() -> dict[tuple[str, str], tuple[str, str]]:
    return {
        (row["scenario"], row["peer_storage"]): (row["prefixd"], row["peer"])
        for row in run_poison("poison_lmcache.py")
    }


def test_prefixd_serves_the_stored_kv_or_nothing(
    lmcache_outcomes: dict[tuple[str, str], tuple[str, str]],
) -> None:
    assert {case: ours for case, (ours, _) in lmcache_outcomes.items()} == {
        case: ours for case, (ours, _) in EXPECTED.items()
    }


def test_lmcaches_own_storage_runs_the_same_scenarios(
    lmcache_outcomes: dict[tuple[str, str], tuple[str, str]],
) -> None:
    assert {case: theirs for case, (_, theirs) in lmcache_outcomes.items()} == {
        case: theirs for case, (_, theirs) in EXPECTED.items()
    }
