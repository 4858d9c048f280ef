"""An in-memory stand-in for torchvision, registered before sglang is imported.

sglang 0.5.23's model configs import torchvision (and its submodules) at import time, and PyPI's
torchvision fails beside the local CPU torch (`operator torchvision::nms does not exist`). The
storage layer these tests drive never calls it, so any torchvision name resolves to an inert
placeholder. transformers is imported first, so it has already decided torchvision is absent.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence
from typing import Any

PREFIX = "torchvision"


class _Placeholder:
    """Any attribute of the stand-in: callable, subscriptable, never used by the storage layer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __class_getitem__(cls, item: Any) -> type[_Placeholder]:
        return cls

    def __getattr__(self, name: str) -> type[_Placeholder]:
        return _Placeholder


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != PREFIX and not fullname.startswith(PREFIX + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+standin"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install() -> None:
    """Register the stand-in (once), after transformers has looked for the real torchvision."""
    import transformers  # noqa: F401  (decides torchvision is unavailable before we register)

    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
