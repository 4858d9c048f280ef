"""The code blocks of the README and the docs pages, as the tests that run them read them
(tests/daemon/test_readme.py checks that every block is run by one)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
# The pages whose blocks the tests run: the README and every page of the docs site.
PAGES = (README, *sorted((REPO / "docs").glob("*.md")))
# The node's paths as the README writes them: each test replaces them by its own.
NODE_SOCKET = "/run/prefixd/prefixd.sock"
NODE_STORE = "/var/lib/prefixd"


def readme_block(heading: str, language: str = "python", page: str = "README.md") -> str:
    """The first `language` code block under `heading` (`# vLLM`, `## Quick start: a node`) of
    `page`, a path from the repository's root (`docs/vllm.md`)."""
    text = "\n" + (REPO / page).read_text()
    section = text[text.index(f"\n{heading}\n") :]
    found = re.search(rf"```{language}\n(.*?)```", section, re.DOTALL)
    assert found is not None, (page, heading)
    return found.group(1)
