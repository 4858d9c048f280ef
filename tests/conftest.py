"""Shared fixtures: a small identity and a fresh store per test (checked on teardown: see
tests/must_check.py); the suite's own environment and a watch on the machine's prefixd paths
(tests/hermetic.py)."""

from __future__ import annotations

import os
import shutil
import signal
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


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C reaches what the tests start, as from a terminal: a runner started in the background
    (`pytest ... &` in a script) ignores SIGINT, and its children inherit that, so a test's Ctrl-C
    to the CLI or a server it started would be lost."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


def _machine_watch(
    runner_env: dict[str, str], *, compare: bool, events: bool = True
) -> DefaultPathWatch:
    """A watch on the machine's prefixd paths (/var/lib/prefixd, /run/prefixd, the runner's
    ~/.local/state/prefixd, ...). A suite run by a test of another (bench/gpu/run.sh's CUDA tests)
    leaves the watch to that one: its own would open those paths to look at them, which the outer
    watch rightly reports."""
    nested = runner_env.get(NESTED_SUITE) == "1"
    dirs = [] if nested else machine_default_dirs(runner_env, os.geteuid())
    return DefaultPathWatch(watched_for(dirs), compare=compare, events=events)


def _distributing(config: pytest.Config) -> bool:
    """Whether this process is the controller of a run in several processes (pytest-xdist)."""
    return config.pluginmanager.hasplugin("dsession")


_RUN_WATCH = pytest.StashKey[DefaultPathWatch]()


def pytest_sessionstart(session: pytest.Session) -> None:
    """In several processes, the run's controller compares the machine's paths from before the
    workers start (xdist starts them after this hook) until after they all ended; the workers'
    watches name the tests that touch them."""
    if _distributing(session.config):
        watch = _machine_watch(dict(os.environ), compare=True, events=False)
        session.config.stash[_RUN_WATCH] = watch


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    watch = session.config.stash.get(_RUN_WATCH, None)
    if watch is None:
        return
    touched = watch.finish()
    if touched:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "the suite touched the machine's prefixd paths:\n" + "\n".join(touched)
        if reporter is not None:
            reporter.write_line(message, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session", autouse=True)
def machine_paths(hermetic: Hermetic, request: pytest.FixtureRequest) -> Iterator[DefaultPathWatch]:
    """The machine's prefixd paths watched for the session; at its end, nothing there has
    changed. A worker of a run in several processes only watches (each test's events): its
    snapshots would be the other workers' events, and the controller compares the paths."""
    worker = hasattr(request.config, "workerinput")
    watch = _machine_watch(hermetic.runner_env, compare=not worker)
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
        "this test (or, in a run of several processes, one beside it) opened or changed the "
        "machine's prefixd paths (a command or client told only part of its store and socket "
        "falls back on the defaults):\n" + "\n".join(touched)
    )
