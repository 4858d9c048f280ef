"""The user-facing pages: the docs site builds with warnings as errors (mkdocs.yml), no page is too
long to read, and none reads as a lab notebook (commit hashes, "this VM", measurement logs).
Their code blocks run in tests/daemon/test_readme.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README_LINES = 300
PAGE_LINES = 400
# What an operator reads: the README, the changelog, the benches' guide and the docs site.
USER_FACING = (
    REPO / "README.md",
    REPO / "CHANGELOG.md",
    REPO / "bench" / "README.md",
    *sorted((REPO / "docs").glob("*.md")),
)
# A hex word of 7 to 40 digits with at least one letter and one digit (a short commit hash, not a
# number), after a word that introduces a revision.
SHORT_HASH = r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b"
LAB_NOTES = {
    "a commit hash": re.compile(r"\b[0-9a-f]{40}\b"),
    "a short commit hash": re.compile(
        rf"\b(?:commit|at|since|before|against|revision|rev\.?)\s+`?{SHORT_HASH}"
        rf"|\b{SHORT_HASH}\s+(?:against|and|or)\b",
        re.IGNORECASE,
    ),
    "a hash as a column or a revision": re.compile(
        rf"(?:^\||\(|\| )\s*{SHORT_HASH}\s*(?:\||\))", re.MULTILINE
    ),
    "the writer's machine": re.compile(
        r"\b(?:this|the|our)\s+(?:2-core\s+)?(?:development\s+)?(?:VM|box)\b|\bour\s+machines?\b",
        re.IGNORECASE,
    ),
    "a measurement log": re.compile(
        r"\bthis\s+revision\b|\bthe\s+revision\s+before\b|\bthis\s+tree\b", re.IGNORECASE
    ),
}


def lab_notes(text: str) -> list[str]:
    """Each place in `text` that reads as a lab note (a phrase may wrap lines), with its line."""
    found = []
    for what, pattern in LAB_NOTES.items():
        for match in pattern.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{line}: {what}: {' '.join(match.group(0).split())}")
    return found


def test_the_lab_note_check_finds_lab_notes() -> None:
    """The check itself, on lines the pages once had."""
    assert lab_notes("measured on this VM (2 cores)")
    assert lab_notes("On the 2-core development VM, one run:")
    assert lab_notes("against the revision before the limits above (7461d23), honest")
    assert lab_notes("| row | 822dcd0 | this revision |")
    assert lab_notes("taken in turn, against d477af0 (`cd /tmp;")
    assert lab_notes("two runs of each side in turn, 5a82dda against the code before")
    assert lab_notes("at commit 0cfecfe6a1b7b8e2a8a1b9c6d4e5f60718293a4b")
    assert lab_notes("its CPU build lies on disk on our machines")
    assert lab_notes("about 6 minutes on the 2-core\nVM): 181 exact")  # wrapped
    # Numbers, digests in examples and words are not hashes.
    assert not lab_notes('up to 1048576 tokens at 1024 blocks; weights="rev=a272c74"')
    assert not lab_notes("a decade of deadbeef words, the VMs' guests, at 4096 keys")


@pytest.mark.parametrize("page", USER_FACING, ids=lambda page: page.relative_to(REPO).as_posix())
def test_user_facing_pages_hold_no_lab_notes(page: Path) -> None:
    assert page.is_file()
    found = lab_notes(page.read_text())
    assert not found, "\n".join(found)


def test_no_page_is_too_long() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= README_LINES
    for page in USER_FACING:
        assert len(page.read_text().splitlines()) <= PAGE_LINES, page


def test_every_docs_page_is_in_the_sites_nav() -> None:
    config = (REPO / "mkdocs.yml").read_text()
    listed = set(re.findall(r":\s+(\S+\.md)\s*$", config, re.MULTILINE))
    assert listed == {page.name for page in (REPO / "docs").glob("*.md")}


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    """`mkdocs build --strict`: a broken link, a page missing from the nav, a snippet of the
    README that is not there or an API reference that names no object fails (mkdocs,
    mkdocs-material and mkdocstrings come with the [test] extra)."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-4000:]
    quick_start = (tmp_path / "site" / "getting-started" / "index.html").read_text()
    assert "useradd" in quick_start  # the README's quick start, included by the snippet
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("client.blocking.Client", "client.operations.load", "store.Store.load"):
        assert f'id="prefixd.{name}"' in api  # generated from the docstrings
