"""Shared fixtures: a small identity and a fresh store per test (checked on teardown: see
tests/must_check.py); the suite's own environment and a watch on the machine's prefixd paths
(tests/hermetic.py)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixd import Identity, Store

from .hermetic import (
    DefaultPathWatch,
    Hermetic,
    hermetic_environment,
    machine_default_dirs,
    watched_for,
)
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
def long_run(request: pytest.FixtureRequest, hermetic: Hermetic) -> bool:
    """Whether the suite runs at length (`--long`, or PREFIXD_LONG=1 where pytest was started)."""
    return (
        bool(request.config.getoption("--long")) or hermetic.runner_env.get("PREFIXD_LONG") == "1"
    )


# --- hermetic: the machine's daemon, HOME and XDG directories are not the suite's ---------------

NESTED_SUITE = "PREFIXD_TEST_NESTED_SUITE"  # "1": run by a test whose suite watches the machine


@pytest.fixture(scope="session", autouse=True)
def hermetic() -> Iterator[Hermetic]:
    """The whole session, its fixtures and every subprocess run in an environment of their own
    (tests/hermetic.py): HOME and the XDG directories are the session's, and no PREFIXD_* setting
    or systemd variable of the runner's reaches them."""
    base = Path(tempfile.mkdtemp(prefix="pdh", dir="/tmp"))  # short: sockets go in it
    try:
        with hermetic_environment(base) as made:
            yield made
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def machine_paths(hermetic: Hermetic) -> Iterator[DefaultPathWatch]:
    """A watch on the machine's prefixd paths (/var/lib/prefixd, /run/prefixd, the runner's
    ~/.local/state/prefixd, ...) for the session; at its end, nothing there has changed. A suite
    run by a test of another (bench/gpu/run.sh's CUDA tests) leaves the watch to that one: its own
    would open those paths to look at them, which the outer watch rightly reports."""
    nested = hermetic.runner_env.get(NESTED_SUITE) == "1"
    dirs = [] if nested else machine_default_dirs(hermetic.runner_env, os.geteuid())
    watch = DefaultPathWatch(watched_for(dirs))
    yield watch
    touched = watch.finish()
    assert not touched, "the suite touched the machine's prefixd paths:\n" + "\n".join(touched)


@pytest.fixture(autouse=True)
def default_paths_of_the_test(
    hermetic: Hermetic, machine_paths: DefaultPathWatch, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """Each test's default store and socket are its own (a fresh directory: whatever a test
    leaves there, the next one does not see), and a test that opened, made or changed anything
    on the machine's prefixd paths fails, named, at its teardown."""
    for name, value in hermetic.per_test().items():
        monkeypatch.setenv(name, value)
    before = machine_paths.drain()  # during this test's setup (fixtures of wider scope too)
    yield
    touched = before + machine_paths.drain()
    assert not touched, (
        "this test opened or changed the machine's prefixd paths (a command or client told only "
        "part of its store and socket falls back on the defaults):\n" + "\n".join(touched)
    )
