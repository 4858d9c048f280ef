"""A Hugging Face hub cache on disk, for a vLLM engine that names its model by repo id, with no
network (runs in the vLLM venv only).

`publish(cache, repo_id, commit, seed=...)` writes the tiny model (tiny_model.py) as that commit's
snapshot and points the repo's `main` at it: what a download leaves after `main` moved.
`serving(cache)` makes huggingface_hub read only that cache, as HF_HUB_OFFLINE does, and keeps
vLLM from putting the snapshot's path in place of the repo id, which it does only offline: the
engine's config then names the model as an online engine's does, its files read from the commit
`main` names."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from .tiny_model import build_tiny_model


def publish(cache: Path, repo_id: str, commit: str, **model: Any) -> Path:
    """The tiny model (`model`: build_tiny_model's arguments) as `commit` of `repo_id`, its
    `main`; the snapshot's directory."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = build_tiny_model(repo / "snapshots" / commit, **model)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


@contextlib.contextmanager
def serving(cache: Path) -> Iterator[None]:
    """Hugging Face's cache is `cache` and the hub is out of reach; the repo id stays the
    model's name in vLLM's config."""
    import huggingface_hub.constants
    import vllm.engine.arg_utils

    def kept(model: str, revision: str | None = None) -> str:
        return model

    with contextlib.ExitStack() as stack:
        constants = huggingface_hub.constants
        stack.enter_context(mock.patch.object(constants, "HF_HUB_CACHE", str(cache)))
        stack.enter_context(mock.patch.object(constants, "HF_HUB_OFFLINE", True))
        stack.enter_context(mock.patch.object(vllm.engine.arg_utils, "get_model_path", kept))
        yield
