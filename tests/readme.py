"""The README's code blocks, as the tests that run them read them (tests/daemon/test_readme.py
checks that every block is run by one)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
# The node's paths as the README writes them: each test replaces them by its own.
NODE_SOCKET = "/run/prefixd/prefixd.sock"
NODE_STORE = "/var/lib/prefixd"


def readme_block(heading: str, language: str = "python") -> str:
    """The first `language` code block under the README's `heading` (`## vLLM`)."""
    text = README.read_text()
    section = text[text.index(f"\n{heading}\n") :]
    found = re.search(rf"```{language}\n(.*?)```", section, re.DOTALL)
    assert found is not None, heading
    return found.group(1)
