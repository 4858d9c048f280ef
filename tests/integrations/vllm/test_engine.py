"""End to end with a real vLLM CPU engine: stock vLLM (OffloadingConnector, TieringOffloadingSpec,
its CPU primary tier) with prefixd as the secondary tier; only the worker's copy between the
model's KV and the primary tier is the test's own (cpu_spec.py: vLLM's refuses the CPU platform).

Process A generates; the daemon restarts; process B, with empty GPU and CPU caches, gets its
prompt's KV from prefixd and the same greedy tokens. With a stored payload damaged on disk, C gets
a miss from that block on (prefixd refuses it) and the tokens of an uncached run: the case where
vLLM's file tier served the damaged bytes as KV. With one identity field changed in the engine's
config, a miss. Each engine is a process of its own (about 10 to 60 s each)."""

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

    def run(self, name: str, *flags: str, offload: bool = True) -> dict[str, Any]:
        out = self.work / f"{name}.json"
        tier = ["--prefixd-socket", str(self.daemon.socket)] if offload else ["--no-offload"]
        command = [
            sys.executable, "-m", "tests.integrations.vllm.engine_run", "--model", str(self.model),
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


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Node]:
    work = tmp_path_factory.mktemp("engine")
    sockdir = Path(tempfile.mkdtemp(prefix="pd", dir="/tmp"))
    try:
        with _factory(work, sockdir) as start:
            yield Node(start(), build_tiny_model(work / "model"), work)
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


def test_another_identity_in_the_engine_config_is_a_miss(node: Node, first: dict[str, Any]) -> None:
    scaled = {"hf_overrides": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}}
    other = node.run("rope", "--engine-args", json.dumps(scaled))
    assert other["num_cached_tokens"] == 0
    bf16 = node.run("bf16", "--dtype", "bfloat16")
    assert bf16["num_cached_tokens"] == 0


def test_a_damaged_payload_is_a_miss_from_that_block_and_the_tokens_stay_right(
    node: Node, first: dict[str, Any]
) -> None:
    node.daemon.stop()
    with Store.open(node.daemon.data_dir) as store:
        # A's chain: the one stored without rope scaling, in float32
        [stored] = [
            p
            for p in store.hottest(1 << 30, tenant="default")
            if "linear" not in p.identity.rope and "dtype=float32 " in p.identity.kv_layout
        ]
        blocks = chain_hashes(stored.identity, stored.tokens)
    corrupt_stored_chunk(node.daemon.data_dir, blocks[DAMAGED])
    node.daemon.start()
    third = node.run("c")
    assert third["num_cached_tokens"] == DAMAGED * BLOCK  # refused there; recomputed from there
    assert third["output_token_ids"] == first["output_token_ids"]
    uncached = node.run("plain", offload=False)
    assert uncached["output_token_ids"] == first["output_token_ids"]
