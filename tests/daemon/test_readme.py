"""The code blocks of the README and of every docs page run as written (sybil reads them): Python
against a daemon the test starts, a library store of its own, and the shell commands where they
run. Only the node's paths are the test's. A block no test runs fails here, so none can rot.

How each kind of block runs:
- python: in one namespace per page, in order, `/run/prefixd/prefixd.sock` being the test
  daemon's socket and `/var/lib/prefixd` a store of the test's; invisible blocks
  (`<!-- invisible-code-block: python -->`) give a block the engine's context and check its result.
- sh: the quick start and the try-out install run on a node of their own
  (tests/daemon/test_quick_start.py); the test commands are .ci/run's (CI runs them, with its
  flags added); an engine's own command line runs in that engine's venv tests, named in a
  `<!-- runs-in: PATH -->` comment before it, whose test file must exist and read it
  (`readme_block(heading, ..., page=...)`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sybil import Document, Example, Sybil
from sybil.parsers.markdown import CodeBlockParser, SkipParser

from prefixd.client import Client

from ..readme import NODE_SOCKET, NODE_STORE, PAGES, readme_block
from .conftest import REPO, DaemonFactory

# The shell blocks a test runs as written on a node (tests/daemon/test_quick_start.py).
ON_A_NODE = ("## Quick start: a node", "## Install and serve (trying it out)")  # README.md's


def run_python(replacements: dict[str, str]) -> Callable[[Example], None]:
    def evaluate(example: Example) -> None:
        if _run_elsewhere(example):
            return
        source = str(example.parsed)
        for old, new in replacements.items():
            source = source.replace(old, new)
        exec(compile(source, f"{example.path}:{example.line}", "exec"), example.namespace)  # noqa: S102 - the README's own blocks

    return evaluate


def commands(block: str) -> list[list[str]]:
    """A shell block's commands, continuation lines joined, split at && and comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    found = []
    for line in joined.splitlines():
        for part in line.split("&&"):
            words = shlex.split(part, comments=True)
            if words:
                found.append(words)
    return found


def ci_runs(command: list[str]) -> bool:
    """.ci/run runs `command`: the same words in order, CI's flags (--quiet, -p ..., -W ...)
    added."""
    for line in commands((REPO / ".ci" / "run").read_text()):
        rest = iter(line)
        if all(any(word == have for have in rest) for word in command):
            return True
    return False


def run_shell(example: Example) -> None:
    block = str(example.parsed)
    heading = _heading_of(example)
    if heading in ON_A_NODE and _page_of(example) == "README.md":
        assert block == readme_block(heading, "sh")  # tests/daemon/test_quick_start.py runs it
        return
    if _run_elsewhere(example):
        return
    missing = [shlex.join(c) for c in commands(block) if not ci_runs(c)]
    assert not missing, f"{example.path}:{example.line}: no test runs {missing}"


def _run_elsewhere(example: Example) -> bool:
    """Whether a `<!-- runs-in: PATH -->` comment hands the block to an engine venv's test file,
    which must exist and read the block under this heading of this page (`readme_block`)."""
    marker = re.search(r"<!-- runs-in: (\S+) -->\s*$", example.document.text[: example.start])
    if marker is None:
        return False
    test_file = REPO / marker.group(1)
    assert test_file.is_file(), f"{example.path}:{example.line}: {test_file} does not exist"
    quoted = test_file.read_text()
    heading = _heading_of(example).lstrip("# ")
    assert "readme_block(" in quoted and heading in quoted, (
        f"{test_file} does not run the block under {heading!r}"
    )
    page = _page_of(example)
    assert page == "README.md" or page in quoted, f"{test_file} does not read {page}"
    return True


def _page_of(example: Example) -> str:
    return Path(example.path).resolve().relative_to(REPO).as_posix()


def _heading_of(example: Example) -> str:
    before = example.document.text[: example.start]
    return re.findall(r"^(#{1,3} .+)$", before, re.MULTILINE)[-1]


def readme(socket: Path, store: Path, page: Path = REPO / "README.md") -> Document:
    replacements = {NODE_SOCKET: str(socket), NODE_STORE: str(store)}
    parsers = [
        CodeBlockParser(language="python", evaluator=run_python(replacements)),
        CodeBlockParser(language="sh", evaluator=run_shell),
        SkipParser(),
    ]
    return Sybil(parsers).parse(page)


@pytest.fixture
def readme_examples(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[list[Example]]:
    """Every page's blocks in order, one namespace per page, all against one daemon."""
    daemon = daemon_factory()
    documents = []
    for page in PAGES:
        document = readme(daemon.socket, tmp_path / f"library-store-{page.stem}", page)
        document.namespace["__name__"] = "readme"
        documents.append(document)
    yield [example for document in documents for example in document.examples()]
    for document in documents:
        client = document.namespace.get("client")
        if isinstance(client, Client):
            client.close()


def test_every_readme_block_runs(readme_examples: list[Example]) -> None:
    failed = []
    for example in readme_examples:
        try:
            example.evaluate()
        except Exception as exc:  # noqa: BLE001 - every block's failure is reported, not the first
            failed.append(f"{_page_of(example)}:{example.line}: {type(exc).__name__}: {exc}")
    assert not failed, "\n".join(failed)
    assert len(readme_examples) >= 15  # the pages' blocks were found (not vacuous)
    pages = {_page_of(example) for example in readme_examples}
    assert {"README.md", "docs/clients.md", "docs/hybrid.md", "docs/vllm.md"} <= pages


def test_the_engine_example_runs_as_written(daemon_factory: DaemonFactory) -> None:
    """The first block an engine's author copies, alone, in a fresh namespace."""
    daemon = daemon_factory()
    code = readme_block("## Use it from an engine", page="docs/clients.md")
    assert NODE_SOCKET in code
    namespace: dict[str, Any] = {"__name__": "readme"}
    source = code.replace(NODE_SOCKET, str(daemon.socket))
    exec(compile(source, "docs/clients.md", "exec"), namespace)  # noqa: S102 - the docs' own blocks
    with Client(daemon.socket) as client:
        assert client.stats()["store"]["blocks"] == 2  # the example stored its two blocks
