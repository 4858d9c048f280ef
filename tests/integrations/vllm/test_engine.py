"""End to end with a real vLLM CPU engine and stock vLLM's OffloadingConnector, both ways prefixd
plugs in: `direct`, prefixd as the whole offloading spec (PrefixdOffloadingSpec, loaded through
`spec_module_path`); `tier`, prefixd as the secondary tier behind TieringOffloadingSpec's CPU
primary tier (only the worker's copy between the model's KV and the primary tier is the test's
own: cpu_spec.py, since vLLM's refuses the CPU platform).

Process A generates; the daemon restarts; process B, with empty GPU and CPU caches, gets its
prompt's KV from prefixd and the same greedy tokens. With a stored payload damaged on disk, C gets
a miss from that block on (prefixd refuses it) and the tokens of an uncached run: the case where
vLLM's file tier served the damaged bytes as KV. With one identity field changed in the engine's
config (RoPE scaling, dtype, block size, the revision of a hub model), a miss: run through the
direct spec only, since both ways derive their identities in one function
(`identity.group_identities`, tests/integrations/vllm/test_identity.py covers each field without an
engine). Each engine is a process of its own (about 10 to 60 s each)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from prefixd import Store
from prefixd.schema.chain import chain_hashes

from ...daemon.conftest import REPO, Daemon, _factory
from ...store.test_faults import corrupt_stored_chunk
from .hub_cache import publish
from .tiny_model import build_tiny_model

pytestmark = pytest.mark.slow

PROMPT = {"random": [300], "seed": 11}  # 9 closed blocks of 32 tokens and an open tail
BLOCK = 32
DAMAGED = 3  # the block whose payload is damaged on disk


@dataclass
class Node:
    daemon: Daemon
    model: Path
    work: Path
    direct: bool

    def run(
        self, name: str, *flags: str, offload: bool = True, model: str | None = None
    ) -> dict[str, Any]:
        out = self.work / f"{name}.json"
        tier = ["--prefixd-socket", str(self.daemon.socket)] if offload else ["--no-offload"]
        if offload and self.direct:
            tier.append("--prefixd-direct")
        command = [
            sys.executable, "-m", "tests.integrations.vllm.engine_run",
            "--model", model or str(self.model),
            "--prompt-json", json.dumps(PROMPT), "--out", str(out), "--max-tokens", "12",
            *tier, *flags,
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-4000:]
        prompt: dict[str, Any] = json.loads(out.read_text())["prompts"][0]
        return prompt


@pytest.fixture(scope="module", params=["direct", "tier"])
def node(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Node]:
    work = tmp_path_factory.mktemp(f"engine-{request.param}")
    sockdir = Path(tempfile.mkdtemp(prefix="pd", dir="/tmp"))
    try:
        with _factory(work, sockdir) as start:
            yield Node(start(), build_tiny_model(work / "model"), work, request.param == "direct")
    finally:
        shutil.rmtree(sockdir, ignore_errors=True)


@pytest.fixture(scope="module")
def first(node: Node) -> dict[str, Any]:
    """Process A: nothing stored yet, so an uncached run; it stores the prompt's closed blocks."""
    result = node.run("a")
    assert result["num_cached_tokens"] == 0
    return result


def test_a_fresh_engine_after_a_daemon_restart_gets_the_prompt_from_prefixd(
    node: Node, first: dict[str, Any]
) -> None:
    node.daemon.restart()
    second = node.run("b")
    assert second["num_cached_tokens"] == 9 * BLOCK
    assert second["output_token_ids"] == first["output_token_ids"]


DIRECT_ONLY = pytest.mark.parametrize("node", ["direct"], indirect=True)


@DIRECT_ONLY
def test_another_identity_in_the_engine_config_is_a_miss(node: Node, first: dict[str, Any]) -> None:
    scaled = {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}
    other = node.run("rope", "--engine-args", json.dumps(scaled))
    assert other["num_cached_tokens"] == 0
    bf16 = node.run("bf16", "--dtype", "bfloat16")
    assert bf16["num_cached_tokens"] == 0
    wider = node.run("block64", "--block-size", "64")
    assert wider["num_cached_tokens"] == 0


@DIRECT_ONLY
def test_another_revision_of_a_hub_model_is_a_miss(node: Node) -> None:
    """The same weights published as another commit that `main` now names: another revision.
    (Weights of their own, so no payload is shared with the local model's: the damage test's.)"""
    cache, repo = node.work / "hub", "prefixd-test/tiny"
    publish(cache, repo, "a" * 40, seed=1)
    hub = ["--hub-cache", str(cache)]
    stored = node.run("hub-a", *hub, model=repo)
    again = node.run("hub-a-again", *hub, model=repo)
    assert (stored["num_cached_tokens"], again["num_cached_tokens"]) == (0, 9 * BLOCK)
    publish(cache, repo, "b" * 40, seed=1)
    moved = node.run("hub-b", *hub, model=repo)
    assert moved["num_cached_tokens"] == 0
    assert moved["output_token_ids"] == stored["output_token_ids"]


def test_a_damaged_payload_is_a_miss_from_that_block_and_the_tokens_stay_right(
    node: Node, first: dict[str, Any]
) -> None:
    node.daemon.stop()
    with Store.open(node.daemon.data_dir) as store:
        # A's chain: the one stored of the local model, without rope scaling, in float32, in
        # blocks of 32 tokens
        [stored] = [
            p
            for p in store.hottest(1 << 30, tenant="default")
            if "linear" not in p.identity.rope
            and "dtype=float32 " in p.identity.kv_layout
            and p.identity.model == str(node.model)
            and p.identity.block_tokens == BLOCK
        ]
        blocks = chain_hashes(stored.identity, stored.tokens)
    corrupt_stored_chunk(node.daemon.data_dir, blocks[DAMAGED])
    node.daemon.start()
    third = node.run("c")
    assert third["num_cached_tokens"] == DAMAGED * BLOCK  # refused there; recomputed from there
    assert third["output_token_ids"] == first["output_token_ids"]
    uncached = node.run("plain", offload=False)
    assert uncached["output_token_ids"] == first["output_token_ids"]
