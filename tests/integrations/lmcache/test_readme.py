"""The `# LMCache node server` block of docs/lmcache.md, run as written (as `lmcache server` is started in
tests/integrations/lmcache/node.py) against a daemon of the test's, until the server answers on
its HTTP port and reports prefixd's adapter connected; then it is stopped as with Ctrl-C.

What the test changes, and why (nothing else):
- `/run/prefixd/prefixd.sock` is the test daemon's socket, `/models/llama-3-8b` the tiny model
  the engine tests build (its files fingerprinted: `weights_from`).
- `--l1-size-gb 8` is 0.25, node.py's: on this CPU build (no pinning, so no lazy allocation)
  LMCache writes every page of its L1 at start.
- At the end: free `--port` and `--http-port` (the defaults, 5555 and 8080, may be taken), and
  `--disable-observability`: its metrics exporter needs opentelemetry-exporter-prometheus, which
  lmcache's `--no-deps` install in this venv leaves out (docs/lmcache.md).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from ...daemon.conftest import Daemon
from ...readme import NODE_SOCKET, readme_block
from ...waiting import wait_for
from ..vllm.tiny_model import build_tiny_model
from .node import LMCACHE, START_S, env, free_port

NODE_MODEL = "/models/llama-3-8b"
L1_SIZE = "--l1-size-gb 8 "


def test_the_node_server_command_serves_with_prefixd_behind_it(
    daemon: Daemon, tmp_path: Path
) -> None:
    block = readme_block("# LMCache node server", "sh", page="docs/lmcache.md")
    assert block.startswith("lmcache server ") and all(
        part in block for part in (NODE_SOCKET, NODE_MODEL, L1_SIZE)
    )
    model = build_tiny_model(tmp_path / "model")
    http_port = free_port()
    command = (
        block.strip().replace(NODE_SOCKET, str(daemon.socket)).replace(NODE_MODEL, str(model))
        .replace(L1_SIZE, "--l1-size-gb 0.25 ")
        + f" --port {free_port()} --http-port {http_port} --disable-observability"
    )  # fmt: skip
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {command}"], stdout=log, stderr=subprocess.STDOUT,
            env={**env(), "PATH": f"{Path(LMCACHE).parent}{os.pathsep}{os.environ['PATH']}"},
        )  # fmt: skip
    adapter: dict[str, Any] = {}

    def settled() -> bool:
        """The server answers /status, and prefixd's adapter in it has connected (its first
        calls, LMCache's own, come soon after the start) or met a problem."""
        if server.poll() is not None:
            raise AssertionError(f"lmcache server exited:\n{log_path.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/status", timeout=5) as got:
                adapter.update(_prefixd_adapter(json.load(got)))
        except OSError:
            return False
        links = (adapter["store_link"], adapter["prefetch_link"])
        return bool(adapter["is_healthy"]) or any(link["last_problem"] for link in links)

    try:
        wait_for(settled, "lmcache server with prefixd's adapter", timeout=START_S, poll_s=0.2)
        assert adapter["socket"] == str(daemon.socket) and adapter["is_healthy"], adapter
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C, as node.py stops it
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    # stopped, not killed: LMCache closes its server and exits 130, as an interrupted command
    assert server.returncode == 128 + signal.SIGINT, log_path.read_text()[-4000:]


def _prefixd_adapter(status: Any) -> dict[str, Any]:
    """The adapter's `report_status()` in the server's /status (wherever LMCache nests it)."""
    if isinstance(status, dict):
        if status.get("type") == "PrefixdL2Adapter":
            return status
        status = list(status.values())
    if isinstance(status, list):
        for value in status:
            found = _prefixd_adapter(value)
            if found:
                return found
    return {}
