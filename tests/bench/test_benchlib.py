"""The benches' shared destination buffers: a limit measured into one must be the machine's."""

from __future__ import annotations

import importlib
import mmap
import sys
from types import ModuleType

import pytest

from tests.bench.benches import ROOT


def _benchlib(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """bench/benchlib.py as the benches import it (from their own directory)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    monkeypatch.delitem(sys.modules, "benchlib", raising=False)
    return importlib.import_module("benchlib")


@pytest.mark.parametrize("size", [0, 1, 4096, 1 << 20, (64 << 20) + 16])
def test_a_touched_buffer_starts_at_a_page_and_is_touched(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A large numpy array starts 16 bytes into a page; a plain file read from a page's start into
    it runs at a third of the page cache's speed on the 2-vCPU VM, which made a bench's file-read
    limit a third of the machine's. Regions are page-aligned; so are the benches' buffers."""
    buffer = _benchlib(monkeypatch).touched_buffer(size)
    assert len(buffer) == size
    assert buffer.flags.writeable
    if size:
        assert buffer.ctypes.data % mmap.PAGESIZE == 0
        assert buffer.min() == buffer.max() == 0xA5
