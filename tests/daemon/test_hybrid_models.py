"""Real models through the daemon: prefill, store the cache, restart the daemon, restore into a
fresh cache in a fresh process, continue, and compare the logits with a full prefill."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

from transformers import DynamicCache

from prefixd.client import Client
from prefixd.integrations.transformers import capture_checkpoint, export_state, state_spec

from ..integrations.models import (
    BLOCK,
    FAMILIES,
    PAGE,
    PREFIX,
    TOL,
    build,
    forward,
    tokens,
)
from ..integrations.restore_from_daemon import DIVERGE, as_ids, identity_for
from .conftest import REPO, Daemon

EARLY = 24  # a sparse checkpoint before the second prompt leaves the stored one
PAGED_ONLY = {"llama", "deepseek_v3"}  # no checkpoint group: every block boundary is reusable


def store_prefix(client: Client, family: str) -> None:
    """Prefill PREFIX tokens in two chunks, with a checkpoint at EARLY and at PREFIX."""
    config, model = build(family)
    ids = tokens()
    cache = DynamicCache(config=config)
    forward(model, ids[:, :EARLY], 0, cache)
    early = capture_checkpoint(config, cache, EARLY, block_tokens=BLOCK)
    forward(model, ids[:, EARLY:PREFIX], EARLY, cache)
    payloads = export_state(config, cache, n_tokens=PREFIX, block_tokens=BLOCK, page_blocks=PAGE)
    checkpoints = {g: {EARLY: early[g], **late} for g, late in payloads.checkpoints.items()}
    stored = client.put_state(
        identity_for(family, config),
        as_ids(ids),
        upto_tokens=PREFIX,
        paged=payloads.paged,
        checkpoints=checkpoints,
    )
    assert stored.stored == PREFIX // BLOCK


def restored_in_a_fresh_process(
    module: str, daemon: Daemon, *args: str, key: str = "family"
) -> dict[str, dict]:
    """Run `python -m module SOCKET ARGS...` (nothing of this process survives in it): its
    results by `key` (the family), one JSON line each."""
    worker = subprocess.run(
        [sys.executable, "-m", module, str(daemon.socket), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    assert worker.returncode == 0, worker.stderr[-4000:]
    return {r[key]: r for r in map(json.loads, worker.stdout.splitlines())}


def test_every_family_continues_exactly_after_a_daemon_restart(daemon: Daemon) -> None:
    with Client(daemon.socket, region_bytes=16 << 20) as client:
        for family in FAMILIES:
            store_prefix(client, family)
    daemon.restart()
    results = restored_in_a_fresh_process("tests.integrations.restore_from_daemon", daemon)
    assert list(results) == FAMILIES
    for family, result in results.items():
        direct, replay = result["direct"], result["replay"]
        print(
            f"{family}: direct {direct['diff']:.2e}, replay from {replay['reusable_tokens']} "
            f"{replay['diff']:.2e}"
        )
        assert direct["reusable_tokens"] == PREFIX
        assert direct["diff"] <= TOL, family
        # the second prompt leaves the stored one inside block 4: the hit falls back to the
        # checkpoint at EARLY, or to block 4's start when there is no checkpoint group
        expected = DIVERGE // BLOCK * BLOCK if family in PAGED_ONLY else EARLY
        assert replay["reusable_tokens"] == expected, family
        assert replay["diff"] <= TOL, family


def test_families_by_layer_kind_after_a_daemon_restart(daemon: Daemon, long_run: bool) -> None:
    """One family of each cache layer kind (every family that restores exactly, under --long)
    through the daemon: store, restart it, restore in a fresh process, continue."""
    from ..integrations import zoo, zoo_daemon

    if long_run:
        families = [f for f in zoo.families() if zoo.check(f).result == "exact"]
    else:
        families = list(zoo.REPRESENTATIVES)
    with Client(daemon.socket, region_bytes=32 << 20) as client:
        for family in families:
            assert zoo_daemon.store(client, family) == zoo_daemon.PREFIX // zoo_daemon.BLOCK
    daemon.restart()
    results = restored_in_a_fresh_process("tests.integrations.zoo_daemon", daemon, *families)
    assert list(results) == families
    for family, result in results.items():
        direct, replay = result["direct"], result["replay"]
        print(
            f"{family}: direct {direct['diff']:.2e}, replay from {replay['reusable_tokens']}"
            f" {replay['diff']:.2e} (the model's own cache: {direct['model_diff']:.2e},"
            f" {replay['model_diff']:.2e})"
        )
        assert direct["reusable_tokens"] == zoo_daemon.PREFIX, family
        # the hit falls back to the checkpoint at EARLY, or to block 4's start for a model
        # whose state is all paged
        config, _ = zoo.build(family)
        spec = state_spec(config, block_tokens=zoo_daemon.BLOCK)
        paged_only = all(group.kind == "paged" for group in spec)
        expected = zoo_daemon.DIVERGE // BLOCK * BLOCK if paged_only else zoo_daemon.EARLY
        assert replay["reusable_tokens"] == expected, family
        for run in (direct, replay):
            # exactly what the model's own cache continues to; within TOL of a full prefill
            # wherever the model's own cache is (gemma4's own cache drifts past 1e-5 here)
            assert run["own_diff"] <= TOL, family
            assert run["diff"] <= TOL or run["model_diff"] > TOL, family
