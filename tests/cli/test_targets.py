"""A command acts only on the store it was told (issue 39, item 4).

A socket where no daemon answers names no store (never an offline run on the default one); a
duration needs its unit; a purge of a tenant or model the store does not hold says so (exit 3);
an OS error is one line naming the path and the fix; offline commands open the store with the
settings `serve` would; a store a daemon serves cannot be opened beside it. The node's default
paths are never used: STATE_DIRECTORY and RUNTIME_DIRECTORY put the defaults in the test's own
directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.errors import StoreBusyError
from prefixd.migrate import runner
from prefixd.store import Store
from prefixd.store.environment import OwnerLock, held_message, held_socket

from ..daemon.conftest import NOBODY, Daemon, DaemonFactory, as_nobody, daemon_env
from ..waiting import DEADLINE_S
from .test_commands import IDENTITY, fill, reported, run

BT = IDENTITY.block_tokens
UNKNOWN = 3  # the exit code of a purge naming what the store does not hold


def defaults_in(tmp_path: Path) -> dict[str, str]:
    """An environment whose default store and socket are the test's own (as systemd's
    StateDirectory= and RuntimeDirectory= would give them)."""
    (tmp_path / "runtime").mkdir(exist_ok=True)
    return {
        "STATE_DIRECTORY": str(tmp_path / "default-store"),
        "RUNTIME_DIRECTORY": str(tmp_path / "runtime"),
        "HOME": str(tmp_path / "home"),
    }


def blocks_in(path: Path) -> int:
    with Store.open(path, create=False) as store:
        return store.stats().blocks


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


# --- a socket names its store, or nothing -----------------------------------------------------


def test_a_socket_where_no_daemon_answers_is_an_error_not_the_default_store(
    tmp_path: Path,
) -> None:
    """verify, purge, compact and migrate told a socket where nothing answers refuse, naming the
    socket and the way out, and leave the default store (which exists) alone."""
    env = defaults_in(tmp_path)
    default = Path(env["STATE_DIRECTORY"])
    fill(default)
    typo = tmp_path / "no-such-dir" / "typo.sock"
    settings = tmp_path / "prefixd.toml"
    settings.write_text(f'[socket]\npath = "{typo}"\n')
    ways = (
        ("--socket", ["--socket", str(typo)], {}),
        ("PREFIXD_SOCKET", [], {"PREFIXD_SOCKET": str(typo)}),
        ("TOML socket", ["--config", str(settings)], {}),
    )
    for how, flags, extra in ways:
        for command in (
            ["verify"],
            ["purge", "--all"],
            ["compact", "--to", str(tmp_path / "copy")],
            ["migrate", "up"],
        ):
            done = run(*command, *flags, env={**env, **extra})
            line = one_line(done.stderr)
            assert done.returncode == 1, (how, command, done.stderr)
            assert str(typo) in line and "--data-dir" in line, (how, command, line)
            assert done.stdout == "", (how, command)
    assert blocks_in(default) == 3  # nothing was purged
    assert not (tmp_path / "copy").exists()


def test_a_socket_alone_names_its_daemons_store_whatever_the_default_store(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Told only a socket, a command goes to the daemon on it, even while the default store is
    served by another daemon (a node whose own daemon runs on the default paths)."""
    node, ours = daemon_factory(), daemon_factory()
    with Client(ours.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, np.arange(2 * BT, dtype=np.uint32), [b"k" * 64] * 2)
    env = {"STATE_DIRECTORY": str(node.data_dir), "RUNTIME_DIRECTORY": str(node.socket.parent)}
    verified = reported(run("verify", "--json", "--socket", str(ours.socket), env=env))
    assert (verified["mode"], verified["path"], verified["blocks"]) == (
        "online",
        str(ours.data_dir),
        2,
    )
    dry = reported(
        run("purge", "--all", "--dry-run", "--json", "--socket", str(ours.socket), env=env)
    )
    assert (dry["path"], dry["blocks"]) == (str(ours.data_dir), 2)


# --- durations --------------------------------------------------------------------------------


def test_a_duration_needs_its_unit(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store)
    tenant = IDENTITY.tenant
    bare = run(
        "purge", "--tenant", tenant, "--older-than", "5", "--dry-run", "--data-dir", str(store)
    )
    line = one_line(bare.stderr)
    assert bare.returncode == 2, bare.stderr
    assert "--older-than" in line and all(unit in line for unit in ("ms", "s", "m", "h", "d"))
    where = ("--dry-run", "--data-dir", str(store))
    for text in ("1e3", "0.5", " 7 "):
        refused = run("purge", "--tenant", tenant, "--older-than", text, *where)
        assert refused.returncode == 2 and "no unit" in refused.stderr, (text, refused.stderr)
    with_unit = reported(run("purge", "--tenant", tenant, "--older-than", "5s", "--json", *where))
    assert with_unit["blocks"] == 0  # written just now: nothing idle for 5 s
    assert blocks_in(store) == 3


# --- unknown tenants and models -----------------------------------------------------------------


def test_purging_an_unknown_tenant_or_model_says_so_offline(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store)
    for flags, says in (
        (["--tenant", "nosuch"], "tenant 'nosuch'"),
        (["--model", "nosuch"], "model 'nosuch'"),
        (["--tenant", IDENTITY.tenant, "--model", "nosuch"], "model 'nosuch'"),
        (["--tenant", "nosuch", "--dry-run"], "tenant 'nosuch'"),
    ):
        done = run("purge", "--json", "--data-dir", str(store), *flags)
        assert done.returncode == UNKNOWN, (flags, done.stderr)
        assert says in one_line(done.stderr), (flags, done.stderr)
        summary = json.loads(done.stdout)
        assert summary["blocks"] == 0 and summary["unknown"], (flags, summary)
    known = reported(
        run("purge", "--json", "--dry-run", "--data-dir", str(store), "--model", IDENTITY.model)
    )
    assert known["blocks"] == 3 and known["unknown"] == []
    assert blocks_in(store) == 3
    documented = " ".join(run("purge", "--help").stdout.split())
    assert "3 the store holds no tenant or model" in documented


def test_purging_an_unknown_tenant_or_model_says_so_through_the_daemon(daemon: Daemon) -> None:
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, np.arange(2 * BT, dtype=np.uint32), [b"k" * 64] * 2)
        tenant = run("purge", "--json", "--socket", str(daemon.socket), "--tenant", "nosuch")
        assert tenant.returncode == UNKNOWN, tenant.stderr
        assert "tenant 'nosuch'" in one_line(tenant.stderr)
        assert json.loads(tenant.stdout)["mode"] == "online"
        model = run("purge", "--socket", str(daemon.socket), "--model", "nosuch", "--dry-run")
        assert model.returncode == UNKNOWN and "model 'nosuch'" in model.stderr, model.stderr
        assert client.purge(model="nosuch", dry_run=True)["unknown"] == ["model"]
        assert client.purge(tenant=IDENTITY.tenant, dry_run=True)["unknown"] == []


# --- OS errors ----------------------------------------------------------------------------------


def test_a_path_that_is_a_file_is_one_line_naming_it_and_the_fix(tmp_path: Path) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("not a store")
    env = defaults_in(tmp_path)
    for command in (
        ["serve", "--socket", str(tmp_path / "runtime" / "s.sock")],
        ["migrate", "up"],
        ["migrate", "status"],
        ["verify"],
        ["purge", "--all"],
        ["compact", "--to", str(tmp_path / "copy")],
    ):
        done = run(*command, "--data-dir", str(afile), env=env)
        line = one_line(done.stderr)
        assert done.returncode == 1, (command, done.stderr)
        assert "Errno" not in line and "owner.lock" not in line, (command, line)
        assert f"{afile} is not a directory" in line and "--data-dir" in line, (command, line)
    assert afile.read_text() == "not a store"


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_a_user_whose_home_does_not_exist_is_told_which_path_and_what_to_do() -> None:
    """`runuser -u nobody -- prefixd serve`: nobody's HOME (/nonexistent) holds its default
    data directory; the error names it and the fix, in one line."""
    from prefixd.cli import main
    from prefixd.daemon import server  # noqa: F401 - imported before the child drops root

    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401

    def serve_as_nobody() -> tuple[int, str]:
        os.environ.clear()
        os.environ.update(HOME="/nonexistent", PATH="/usr/bin:/bin")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["serve"])
        return code, err.getvalue()

    kind, outcome = as_nobody(serve_as_nobody)
    assert kind == "ok", outcome
    code, stderr = outcome
    line = one_line(stderr)
    assert code == 1 and "Errno" not in line, stderr
    assert "/nonexistent" in line and "HOME" in line and "--data-dir" in line, line


def test_the_vllm_helper_without_vllm_names_the_extra(tmp_path: Path) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    helper = [sys.executable, "-m", "prefixd.integrations.vllm", "--socket", str(tmp_path / "s")]
    done = subprocess.run(
        [*helper, "--", "--model", "m"],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=daemon_env(),
        check=False,
    )
    line = one_line(done.stderr)
    assert done.returncode in (1, 2) and "pip install 'prefixd[vllm]'" in line, done.stderr
    assert done.stdout == ""


# --- the settings serve uses; a served store ------------------------------------------------


def test_offline_commands_open_the_store_with_the_settings_serve_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixd.cli import main

    store = tmp_path / "store"
    fill(store)
    opened: list[Any] = []
    real_init = Store.__init__

    def spy(self: Store, config: Any, **kwargs: Any) -> None:
        opened.append(config)
        real_init(self, config, **kwargs)

    monkeypatch.setattr(Store, "__init__", spy)
    real_open = runner.open_environment

    def spy_open(config: Any, **kwargs: Any) -> Any:  # the migrations open the environment
        opened.append(config)
        return real_open(config, **kwargs)

    monkeypatch.setattr(runner, "open_environment", spy_open)
    for key in [k for k in os.environ if k.startswith("PREFIXD_")]:
        monkeypatch.delenv(key)
    for key, value in defaults_in(tmp_path).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("PREFIXD_MAP_SIZE", "256MiB")
    monkeypatch.setenv("PREFIXD_DURABILITY", "full")
    monkeypatch.setenv("PREFIXD_MAX_READERS", "100")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        for argv in (
            ["verify", "--quiet"],
            ["purge", "--all", "--dry-run", "--quiet"],
            ["compact", "--to", str(tmp_path / "copy"), "--quiet"],
            ["migrate", "status"],
            ["migrate", "up", "--quiet"],
        ):
            assert main([*argv, "--json", "--data-dir", str(store)]) == 0, argv
    assert len(opened) == 5
    for config in opened:
        assert (config.path, config.create) == (store, False)
        assert (config.map_size, config.durability.value, config.max_readers) == (
            256 << 20,
            "full",
            100,
        )


@pytest.mark.skipif(os.geteuid() != 0, reason="a store of another user's needs root")
def test_roots_offline_commands_leave_the_service_users_store_openable_by_it(
    sock_dir: Path,
) -> None:
    """Root runs the offline commands on a store its daemon's user (here 65534) owns: every file
    they create there (data.mdb, lock.mdb, owner.lock) is that user's, so the daemon starts."""
    sock_dir.chmod(0o711)  # the service user passes through to its own directory
    store = sock_dir / "store"
    store.mkdir(mode=0o700)
    os.chown(store, NOBODY, NOBODY)
    fill(store)  # root creates the store in the service user's (empty) directory
    for argv in (
        ["verify"],
        ["migrate", "status"],
        ["migrate", "up"],
        ["purge", "--all", "--dry-run"],
        ["compact", "--to", str(sock_dir / "copy")],
    ):
        for leftover in ("lock.mdb", "owner.lock"):  # each command creates its own
            (store / leftover).unlink(missing_ok=True)
        reported(run(*argv, "--json", "--data-dir", str(store)))
        owners = {p.name: (p.stat().st_uid, p.stat().st_gid) for p in store.iterdir()}
        assert set(owners.values()) == {(NOBODY, NOBODY)}, (argv, owners)
        opened = as_nobody(lambda: Store.open(store, create=False, exclusive=True).close())
        assert opened == ("ok", None), (argv, opened)


def test_a_store_a_daemon_serves_cannot_be_opened_beside_it(daemon: Daemon) -> None:
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, np.arange(BT, dtype=np.uint32), [b"k" * 64])
    for exclusive in (False, True):
        with pytest.raises(StoreBusyError) as refused:
            Store.open(daemon.data_dir, create=False, exclusive=exclusive)
        assert str(daemon.socket) in str(refused.value), refused.value
    # the daemon goes on serving
    with Client(daemon.socket) as client:
        assert client.lookup(IDENTITY, [np.arange(BT, dtype=np.uint32)])[0].n_blocks == 1


def test_a_users_own_store_is_not_traded_for_the_nodes_while_its_daemon_is_stopped(
    daemon_factory: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user whose own daemon is stopped, on a node whose daemon runs: a command without flags
    works on the user's own store offline, never on the node's (a purge there would empty it).
    Only a user with no store of its own is sent to the node's daemon."""
    from prefixd.cli import endpoints, parser

    node = daemon_factory()
    env = defaults_in(tmp_path)
    own = Path(env["STATE_DIRECTORY"])
    Store.open(own).close()
    monkeypatch.setattr(endpoints, "node_socket", lambda instance="": node.socket)
    args = parser().parse_args(["purge", "--all", "--dry-run"])
    found = endpoints.target(args, env, timeout=DEADLINE_S)
    assert (found.data_dir, found.served) == (own, False)
    shutil.rmtree(own)
    assert endpoints.target(args, env, timeout=DEADLINE_S).data_dir == node.data_dir


def test_a_held_store_names_only_a_daemon_that_serves_it(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """A held store records its daemon's socket. Another daemon bound at that path since (the
    first one's socket file removed) serves another store: a command given the first store's
    directory must not purge the second's."""
    first = daemon_factory()
    os.unlink(first.socket)
    second = daemon_factory(socket_path=first.socket)
    with Client(second.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, np.arange(3 * IDENTITY.block_tokens, dtype=np.uint32), [b"x"] * 3)
    done = run("purge", "--all", "--json", "--data-dir", str(first.data_dir))
    assert done.returncode == 2, done.stderr
    assert f"serves {second.data_dir}" in one_line(done.stderr)
    second.stop()
    assert blocks_in(second.data_dir) == 3


def test_a_store_no_daemon_serves_keeps_no_socket_of_an_earlier_one(
    daemon_factory: DaemonFactory,
) -> None:
    """A daemon's record of its socket goes with it: whatever holds the store next (an offline
    command) is not taken for a daemon serving on that socket."""
    daemon = daemon_factory()
    daemon.stop()
    lock = OwnerLock(daemon.data_dir)  # held, as an offline command holds it
    try:
        assert held_socket(daemon.data_dir) is None
        assert str(daemon.socket) not in held_message(daemon.data_dir)
    finally:
        lock.release()


def test_offline_only_commands_leave_a_listening_socket_unit_alone(tmp_path: Path) -> None:
    """The service stopped, its socket unit listening: compact and migrate, given no flag, work
    on the default store (there, held by nobody) without connecting. A connection would start
    the daemon, which would then hold the store they need."""
    env = defaults_in(tmp_path)
    fill(Path(env["STATE_DIRECTORY"]))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unit:  # as systemd's listens
        unit.bind(str(tmp_path / "runtime" / "prefixd.sock"))
        unit.listen(8)
        unit.setblocking(False)
        for command in (
            ["migrate", "status"],
            ["migrate", "up"],
            ["compact", "--to", str(tmp_path / "copy")],
        ):
            done = run(*command, "--json", env=env)
            assert done.returncode == 0, (command, done.stderr)
            with pytest.raises(BlockingIOError):  # nothing connected: nothing was started
                unit.accept()[0].close()


@pytest.mark.parametrize(
    ("name", "units"),
    [("prefixd", "prefixd.socket prefixd.service"), ("prefixd-gpu0", "prefixd@gpu0.socket")],
)
def test_a_held_node_store_says_to_stop_both_units(tmp_path: Path, name: str, units: str) -> None:
    """Stopping the service alone leaves its socket unit to start it again at the next
    connection: the refusal names both units."""
    store = tmp_path / name
    Store.open(store).close()
    lock = OwnerLock(store)
    try:
        with pytest.raises(StoreBusyError) as refused:
            Store.open(store, create=False, exclusive=True)
        assert f"systemctl stop {units}" in str(refused.value), refused.value
    finally:
        lock.release()
