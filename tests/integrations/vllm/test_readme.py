"""The README's `## vLLM` blocks, run as written against a daemon of the test's: the Python block
builds an LLM with prefixd behind it, and the `vllm serve` command line serves (with the
`$(python -m prefixd.integrations.vllm ...)` substitution) until its /health answers. Each runs in a
process of its own on the tiny model (tests/integrations/vllm/tiny_model.py), with a tokenizer added:
neither block skips the tokenizer.

What the test changes, and why (nothing else):
- `MODEL` is the tiny model, `/run/prefixd/prefixd.sock` the test daemon's socket.
- The CPU primary tier is 8 MiB, not 8 GiB: vLLM writes every page of it into /dev/shm at start.
- vLLM's `TieringOffloadingSpec`, which the transfer config names, is made with the test's CPU copy
  (cpu_spec.py, by the vLLM plugin `use_the_cpu_copy`): vLLM refuses to offload on a CPU platform;
  everything else in it is stock.
- `vllm serve` gets `--host 127.0.0.1`, a free `--port` and `--enforce-eager` at the end.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ...readme import readme_block
from ...waiting import wait_for

if TYPE_CHECKING:
    from ...daemon.conftest import Daemon

pytestmark = pytest.mark.slow

HEADING = "## vLLM"
NODE_SOCKET = "/run/prefixd/prefixd.sock"
TENANT = "acme"  # the README's
REPO = Path(__file__).resolve().parents[3]
SERVE_START_S = 600.0  # a failure bound: `vllm serve` answers within a minute here
PLUGIN = "tests.integrations.vllm.test_readme:use_the_cpu_copy"


def use_the_cpu_copy() -> None:
    """vLLM general plugin, loaded by every process of the engines this test starts: vLLM's
    TieringOffloadingSpec with the test's CPU copy between the model's KV and the primary tier."""
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    from .cpu_spec import CPUTieringOffloadingSpec

    OffloadingSpecFactory._registry["TieringOffloadingSpec"] = lambda: CPUTieringOffloadingSpec


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, with a word-level tokenizer over its vocabulary (`t0` ... `t2047`)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from .tiny_model import VOCAB, build_tiny_model

    path = build_tiny_model(tmp_path_factory.mktemp("readme") / "model")
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="t0", bos_token="t1", eos_token="t2"
    )
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def engine_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of an engine process: this venv first on PATH (its `vllm` and `python`),
    the worktree importable, and the plugin above registered (a distribution on PYTHONPATH)."""
    plugins = tmp_path_factory.mktemp("plugins")
    dist = plugins / "prefixd_readme_cpu_copy-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: prefixd-readme-cpu-copy\n")
    (dist / "entry_points.txt").write_text(f"[vllm.general_plugins]\ncpu_copy = {PLUGIN}\n")
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": f"{plugins}{os.pathsep}{REPO}",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def stored_blocks(daemon: Daemon) -> int:
    from prefixd.client import Client

    with Client(daemon.socket, region_bytes=1 << 20) as client:
        tenant = client.stats()["metrics"]["tenants"].get(TENANT, {})
    return int(tenant.get("stored_blocks", 0))


# After the block: one prompt of 3 closed blocks through the LLM, stepped until the connector's
# stores are done (as engine_run does), so the test can see them in the daemon.
AFTER_THE_BLOCK = """
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 3 + 100)))],
             SamplingParams(max_tokens=1), use_tqdm=False)
scheduler = llm.llm_engine.engine_core.engine_core.scheduler
while scheduler.has_requests():
    llm.llm_engine.step()
print("tiers:", [type(t).__name__ for t in scheduler.connector.connector_scheduler.manager.secondary_tiers])
llm.llm_engine.engine_core.shutdown()
"""


def test_the_python_block_builds_an_llm_with_prefixd_behind_it(
    daemon: Daemon, model: Path, engine_env: dict[str, str]
) -> None:
    block = readme_block(HEADING)
    assert NODE_SOCKET in block and "8 << 30" in block
    code = block.replace(NODE_SOCKET, str(daemon.socket)).replace("8 << 30", "8 << 20")
    env = {**engine_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # its scheduler, here: stepped
    done = subprocess.run(
        [sys.executable, "-c", f"MODEL = {str(model)!r}\n{code}{AFTER_THE_BLOCK}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=SERVE_START_S,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "tiers: ['PrefixdTier']" in done.stdout, done.stdout[-2000:]
    assert stored_blocks(daemon) == 3  # the prompt's closed blocks, under the block's tenant


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_vllm_serve_with_the_helpers_transfer_config_serves(
    daemon: Daemon, model: Path, engine_env: dict[str, str], tmp_path: Path
) -> None:
    block = readme_block(HEADING, "sh")
    assert block.startswith("vllm serve MODEL ") and NODE_SOCKET in block and "8GiB" in block
    port = free_port()
    command = (
        block.strip().replace("MODEL", str(model)).replace(NODE_SOCKET, str(daemon.socket))
        .replace("8GiB", "8MiB")
        # loopback only, and no compilation of the model (minutes of a 2-core CPU)
        + f" --host 127.0.0.1 --port {port} --enforce-eager"
    )  # fmt: skip
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], cwd=tmp_path, env=engine_env,
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if server.poll() is not None:
            raise AssertionError(f"vllm serve exited:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as answer:
                return int(answer.status) == 200
        except OSError:
            return False

    try:
        wait_for(healthy, "vllm serve answering /health", timeout=SERVE_START_S, poll_s=0.2)
        # one completion of a prompt of 3 closed blocks: the engine stores them in prefixd
        body = {"model": str(model), "prompt": list(range(3, 3 + 100)), "max_tokens": 1}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as answer:
            assert json.load(answer)["choices"], "no completion"
        wait_for(lambda: stored_blocks(daemon) == 3, "the prompt's blocks in prefixd")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode == 0, log_path.read_text()[-4000:]
