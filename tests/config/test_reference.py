"""docs/settings.md is the settings as prefixd.config describes them, and the README and
docs/operating.md name its tables."""

from __future__ import annotations

from pathlib import Path

from prefixd.config.settings import DEPRECATED, TABLES
from prefixd.config.sources import reference

REPO = Path(__file__).resolve().parents[2]


def test_the_settings_reference_is_generated_from_the_settings() -> None:
    """Regenerate with: python -c "from prefixd.config.sources import reference;
    print(reference(), end='')" > docs/settings.md"""
    assert (REPO / "docs" / "settings.md").read_text() == reference()


def test_serve_has_few_settings_in_few_tables() -> None:
    documented = sum(len(names) for names in TABLES.values()) - len(DEPRECATED)
    assert documented <= 40
    assert len(TABLES) <= 7
    assert documented == reference().count("\n| `")
    for page in ("README.md", "docs/operating.md"):
        text = (REPO / page).read_text()
        assert all(f"`[{table}]`" in text for table in TABLES), page
