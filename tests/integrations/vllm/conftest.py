"""The vLLM tier's tests run in the vLLM venv (.ci/vllm-venv), where they must not skip; the
main suite's venv has no vLLM (it pins other transformers and numpy versions), so there they are
not collected at all."""

from __future__ import annotations

import importlib.util
import os

# The daemon the tier talks to, started as the daemon tests start it.
from ...daemon.conftest import daemon, daemon_factory, sock_dir  # noqa: F401

if importlib.util.find_spec("vllm") is None and os.environ.get("PREFIXD_REQUIRE_VLLM") == "1":
    raise RuntimeError("PREFIXD_REQUIRE_VLLM=1 but vllm is not importable: run in .venv-vllm")
collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
