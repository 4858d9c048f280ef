"""The suite is hermetic (tests/hermetic.py): what its tests and their subprocesses see names no
directory of the machine's, and a test that touches the machine's prefixd paths all the same is
named. `.ci/run` runs the suite beside a daemon on the default paths, as a root install has one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from prefixd.config.sources import config_from_sources

from .daemon.conftest import command_env, daemon_env
from .hermetic import (
    SYSTEMD_HANDOFF,
    DefaultPathWatch,
    Hermetic,
    machine_default_dirs,
    watched_for,
)

OWN = ("HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "XDG_DATA_HOME", "XDG_STATE_HOME")
DEFAULTS = ("XDG_RUNTIME_DIR", "STATE_DIRECTORY", "RUNTIME_DIRECTORY")


def inside(path: Path | str, base: Path) -> bool:
    return Path(path).resolve().is_relative_to(base.resolve())


@pytest.mark.parametrize("uid", [0, 1000], ids=["root", "user"])
def test_the_defaults_tests_see_are_their_own(
    hermetic: Hermetic, uid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HOME, the XDG directories and the store and socket a command falls back on are the
    session's (as root too: systemd's variables move root's defaults), and the runner's PREFIXD_*
    settings and systemd variables reach no test."""
    for name in (*OWN, *DEFAULTS):
        assert inside(os.environ[name], hermetic.base), (name, os.environ[name])
    assert not [name for name in os.environ if name.startswith("PREFIXD_")]
    assert not (set(SYSTEMD_HANDOFF) - set(DEFAULTS)) & set(os.environ)
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    environments = {"os.environ": dict(os.environ), "command_env": command_env()}
    if uid != 0:  # daemon_env has root's FHS defaults: a daemon under test is told its paths
        environments["daemon_env"] = daemon_env()
    for how, env in environments.items():
        config = config_from_sources({}, env, None)
        assert inside(config.store.data_dir, hermetic.base), (how, config.store.data_dir)
        assert inside(config.socket.path, hermetic.base), (how, config.socket.path)


def test_engines_name_their_sockets_in_the_sessions_directory(hermetic: Hermetic) -> None:
    """vLLM names a ZeroMQ socket per engine process in VLLM_RPC_BASE_PATH: the session's,
    removed with it, open to an engine of any user as /tmp is."""
    path = Path(os.environ["VLLM_RPC_BASE_PATH"])
    assert inside(path, hermetic.base) and path.is_dir()
    assert path.stat().st_mode & 0o7777 == 0o1777


def test_each_test_has_its_own_default_store(hermetic: Hermetic) -> None:
    """What one test leaves in its default store, no other sees."""
    state = Path(os.environ["STATE_DIRECTORY"])
    assert inside(state, hermetic.base / "tests") and not state.exists()
    assert hermetic.per_test()["STATE_DIRECTORY"] != str(state)


def test_the_machines_paths_are_the_runners_defaults(tmp_path: Path) -> None:
    runner = {"HOME": str(tmp_path), "XDG_RUNTIME_DIR": "/run/user/1000", "STATE_DIRECTORY": "/s"}
    dirs = machine_default_dirs(runner, 1000)
    assert dirs[:2] == [Path("/var/lib/prefixd"), Path("/run/prefixd")]
    for path in (
        tmp_path / ".local" / "state" / "prefixd",
        Path("/tmp/prefixd-1000"),
        Path("/run/user/1000/prefixd"),
        Path("/s"),
    ):
        assert path in dirs


def test_the_watch_names_what_was_done_to_a_default_path(tmp_path: Path) -> None:
    """Opening, making, renaming or removing anything of a default store or socket directory,
    or of an instance's beside it, is named (by the test that did it, or at the end where its
    parent did not exist to be watched); looking at them, a file already open being written (a
    serving daemon) and other names are not."""
    store = tmp_path / "var-lib" / "prefixd"
    store.mkdir(parents=True)
    (store / "owner.lock").write_text('{"socket": "/run/prefixd/prefixd.sock"}')
    data = (store / "data.mdb").open("wb")  # the daemon's, open before the watch
    (tmp_path / "run").mkdir()
    home = tmp_path / "home"
    home.mkdir()
    dirs = [store, tmp_path / "run" / "prefixd", home / ".local" / "state" / "prefixd"]
    watch = DefaultPathWatch(watched_for(dirs))
    try:
        assert watch.drain() == []
        (store / "owner.lock").stat()
        (tmp_path / "run" / "prefixd").exists()
        data.write(b"x" * 4096)
        data.flush()
        (tmp_path / "run" / "elsewhere").mkdir()
        (tmp_path / "var-lib" / "other").mkdir()
        assert watch.drain() == []
        (store / "owner.lock").read_text()  # what a command does to find the daemon
        assert watch.drain() == [f"{store}/owner.lock: opened"]
        (tmp_path / "run" / "prefixd-gpu0").mkdir()
        (store / "owner.lock").rename(store / "moved")
        (home / ".local" / "state" / "other").mkdir(parents=True)
        assert watch.drain() == [
            f"{tmp_path}/run/prefixd-gpu0/: created",
            f"{store}/owner.lock: moved away",
            f"{store}/moved: moved in",
        ]
        (home / ".local" / "state" / "prefixd").mkdir()  # where no watch could be: seen at the end
        assert watch.drain() == []
        finished = watch.finish()  # the events since the drain (none), then the snapshot's
        assert finished[:4] == [
            f"created: {home}/.local/state/prefixd",
            f"created: {tmp_path}/run/prefixd-gpu0",
            f"created: {store}/moved",
            f"removed: {store}/owner.lock",
        ]
        # and the directory's mtime, unless the clock's tick has not moved since it was made
        assert {line.split(" (")[0] for line in finished[4:]} <= {f"changed: {store}"}
    finally:
        watch.close()
        data.close()


def test_a_workers_watch_opens_nothing_that_another_watch_reports(tmp_path: Path) -> None:
    """In a run of several processes each worker watches the machine's paths: a watch's snapshot
    opens them, which every other watch reports, so a worker's watch takes none (the run's
    controller compares them) and reports only what is done there."""
    store = tmp_path / "prefixd"
    store.mkdir()
    (store / "data.mdb").write_bytes(b"")
    dirs = watched_for([store])
    worker, beside = DefaultPathWatch(dirs, compare=False), DefaultPathWatch(dirs, compare=False)
    try:
        assert worker.finish() == []  # one worker ends while the other still runs
        assert beside.drain() == []
        comparing = DefaultPathWatch(dirs)  # a watch that compares: its snapshot is reported
        comparing.finish()
        assert f"{store}/: opened" in beside.drain()
        (store / "data.mdb").read_bytes()
        assert beside.finish() == [f"{store}/data.mdb: opened"]
    finally:
        worker.close()
        beside.close()


def test_the_controllers_watch_compares_with_no_queue_to_overflow(tmp_path: Path) -> None:
    """A run's controller never drains its watch until the run ends, and the workers' temporary
    files beside a watched path (/tmp/prefixd-UID among /tmp's) fill an inotify queue past its
    limit: its watch compares snapshots only, and still sees what was made there."""
    parent = tmp_path / "tmp"
    parent.mkdir()
    dirs = watched_for([parent / "prefixd-0"])
    undrained, controller = DefaultPathWatch(dirs), DefaultPathWatch(dirs, events=False)
    try:
        besides = [parent / "pytest-of-root", parent / "tmpa1b2c3"]  # in turn: events coalesce
        for beside in besides:
            beside.write_bytes(b"")
        limit = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
        for n in range(limit + 1):
            os.close(os.open(besides[n % 2], os.O_RDONLY))
        assert any("overflowed" in line for line in undrained.finish())
        (parent / "prefixd-0").mkdir()
        assert controller.finish() == [f"created: {parent}/prefixd-0"]
    finally:
        undrained.close()
        controller.close()


def test_what_the_tests_start_takes_ctrl_c() -> None:
    """A runner started in the background ignores SIGINT, which every process it starts would
    inherit: the CLI's and servers' Ctrl-C tests would wait for an exit that never comes. The
    suite's processes start as from a terminal."""
    import signal
    import subprocess

    status = subprocess.run(
        ["cat", "/proc/self/status"], capture_output=True, text=True, check=True
    ).stdout
    ignored = int(next(x for x in status.splitlines() if x.startswith("SigIgn:")).split()[1], 16)
    assert not ignored & 1 << (signal.SIGINT - 1)
