"""The poison suite's multimodal row (bench/poison_mm.py): the same placeholder token ids with
another image restore exactly through prefixd, while a chain over token ids alone serves the first
image's state."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_another_image_under_the_same_placeholders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import poison_mm

    [row] = poison_mm.rows()
    assert row.prefixd == "exact"
    assert row.peer == "wrong"  # what prefixd's chain did before it covered the images
