"""The SGLang backend's tests run in the SGLang venv (.ci/sglang-venv), where they must not skip;
the main suite's venv has no sglang, so there they are not collected at all. sglang's model
configs import torchvision, which does not load beside the CPU torch: the stand-in
(tests/integrations/sglang/standin.py) is registered before any test module imports sglang."""

from __future__ import annotations

import importlib.util
import os

# The daemon the backend talks to, started as the daemon tests start it.
from ...daemon.conftest import daemon, daemon_factory, sock_dir  # noqa: F401

if importlib.util.find_spec("sglang") is None and os.environ.get("PREFIXD_REQUIRE_SGLANG") == "1":
    raise RuntimeError("PREFIXD_REQUIRE_SGLANG=1 but sglang is not importable: run in .venv-sglang")
if importlib.util.find_spec("sglang") is not None:
    from .standin import install

    install()
collect_ignore_glob = [] if importlib.util.find_spec("sglang") else ["test_*.py", "harness.py"]
