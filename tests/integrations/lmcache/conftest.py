"""The LMCache adapter's tests run in the vLLM venv with lmcache added (.ci/lmcache-venv), where
they must not skip; the main suite's venv has no LMCache, so there they are not collected."""

from __future__ import annotations

import importlib.util
import os

# The daemon the adapter talks to, started as the daemon tests start it.
from ...daemon.conftest import daemon, daemon_factory, sock_dir  # noqa: F401

if importlib.util.find_spec("lmcache") is None and os.environ.get("PREFIXD_REQUIRE_LMCACHE") == "1":
    raise RuntimeError("PREFIXD_REQUIRE_LMCACHE=1 but lmcache is not importable: run in .venv-vllm")
collect_ignore_glob = [] if importlib.util.find_spec("lmcache") else ["test_*.py"]
