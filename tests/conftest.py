"""Shared fixtures: a small identity and a fresh store per test (checked on teardown: see
tests/must_check.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixd import Identity, Store

from .must_check import assert_store_checks, checks_on_teardown


@pytest.fixture
def identity() -> Identity:
    return Identity(
        model="m",
        weights="w",
        tokenizer="t",
        template="c",
        rope="r",
        kv_layout="bf16",
        block_tokens=4,
        tenant="a",
    )


@pytest.fixture
def store(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Store]:
    with Store.open(tmp_path / "store", map_size=64 << 20) as opened:
        yield opened
        if checks_on_teardown(request):
            assert_store_checks(opened)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--long",
        action="store_true",
        help="run the fault tests at length (many more kills, corruptions and fuzzed frames)",
    )


@pytest.fixture(scope="session")
def long_run(request: pytest.FixtureRequest) -> bool:
    """Whether the suite runs at length (`--long`, or PREFIXD_LONG=1)."""
    import os

    return bool(request.config.getoption("--long")) or os.environ.get("PREFIXD_LONG") == "1"
