"""The vLLM tier's tests run in the vLLM venv (.ci/vllm-venv), where they must not skip; the
main suite's venv has no vLLM (it pins other transformers and numpy versions), so there they are
not collected at all."""

from __future__ import annotations

import importlib.util
import os
import sys

# The daemon the tier talks to, started as the daemon tests start it.
from ...daemon.conftest import daemon, daemon_factory, sock_dir  # noqa: F401

if importlib.util.find_spec("vllm") is None and os.environ.get("PREFIXD_REQUIRE_VLLM") == "1":
    raise RuntimeError("PREFIXD_REQUIRE_VLLM=1 but vllm is not importable: run in .venv-vllm")
collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]

# A newer vLLM's offloading code (.ci/vllm-offload extracts it from that release's wheel) in place
# of the installed release's: its pure-Python parts (the offloading API, the tiering manager, the
# connector's scheduler side) are what the tier and the spec meet, and they run on this CPU machine.
OFFLOAD_FROM = "PREFIXD_VLLM_OFFLOAD_FROM"
OFFLOADED = os.environ.get(OFFLOAD_FROM) or None  # read now: each test's environment is its own
if OFFLOADED:
    overlay = os.path.join(OFFLOADED, "vllm")
    for name, inside in (
        ("vllm.v1", "v1"),
        ("vllm.distributed.kv_transfer.kv_connector.v1", "distributed/kv_transfer/kv_connector/v1"),
    ):
        package = importlib.import_module(name)  # the second imports vLLM's CPU tier: overlaid
        if any(m.startswith((f"{name}.kv_offload", f"{name}.offloading")) for m in sys.modules):
            raise RuntimeError(f"{OFFLOAD_FROM}: vLLM's offloading code was imported already")
        package.__path__.insert(0, os.path.join(overlay, inside))
