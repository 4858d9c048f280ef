"""The vLLM tier's tests run in the vLLM venv (.ci/vllm-venv), where they must not skip; the
main suite's venv has no vLLM (it pins other transformers and numpy versions), so there they are
not collected at all."""

from __future__ import annotations

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
