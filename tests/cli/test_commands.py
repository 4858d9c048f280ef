"""The `prefixd` command as an operator runs it: the installed command, in a subprocess.

Every command reads the settings `serve` reads; a store and its daemon are found from either;
output a script can trust (JSON on every command, no tracebacks, exit 2 for bad values, progress
only on a terminal); help and completion; a refused `serve` creates nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import pty
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.store import Store

from ..daemon.conftest import (
    Daemon,
    DaemonFactory,
    command_env,
    daemon_env,
    make_identity,
    payload,
)
from ..store.test_faults import corrupt_payload
from ..waiting import DEADLINE_S

PREFIXD = str(Path(sys.executable).parent / "prefixd")  # the installed console script
IDENTITY = make_identity()
BT = IDENTITY.block_tokens
COMMANDS = ("serve", "stats", "health", "verify", "purge", "compact", "migrate", "completion")


def run(
    *args: str, env: dict[str, str] | None = None, home: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """The installed command with no PREFIXD_* of ours and defaults of the test's own (never the
    machine's daemon's); `home` puts them in it, a store under ~/.local/state for any user (root's
    through systemd's variables)."""
    extra = dict(env or {})
    if home is not None:
        extra.update(HOME=str(home), XDG_STATE_HOME="", XDG_RUNTIME_DIR=str(home / "run"))
        extra.update(
            STATE_DIRECTORY=str(home / ".local" / "state" / "prefixd"),
            RUNTIME_DIRECTORY=str(home / "run" / "prefixd"),
        )
    return subprocess.run(
        [PREFIXD, *args],
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=command_env(**extra),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def reported(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def fill(path: Path, n_blocks: int = 3) -> None:
    with Store.open(path, map_size=64 << 20) as store:
        prompt = np.arange(n_blocks * BT, dtype=np.uint32) + 7
        store.put(IDENTITY, prompt, [payload(1, i) for i in range(n_blocks)])


def test_every_command_reads_the_settings_serve_reads(tmp_path: Path) -> None:
    """PREFIXD_DATA_DIR and a --config file name the store for verify, purge, migrate and
    compact as they do for serve."""
    store = tmp_path / "srv" / "store"
    fill(store)
    home = tmp_path / "home"
    settings = tmp_path / "prefixd.toml"
    settings.write_text(f'data_dir = "{store}"\n')
    for how, flags, env in (
        ("environment", [], {"PREFIXD_DATA_DIR": str(store)}),
        ("config file", ["--config", str(settings)], {}),
        ("PREFIXD_CONFIG", [], {"PREFIXD_CONFIG": str(settings)}),
    ):
        verified = reported(run("verify", "--json", *flags, env=env, home=home))
        assert (verified["path"], verified["blocks"]) == (str(store), 3), how
        status = reported(run("migrate", "status", "--json", *flags, env=env, home=home))
        assert status["pending"] == [], how
        dry = reported(run("purge", "--all", "--dry-run", "--json", *flags, env=env, home=home))
        assert (dry["path"], dry["blocks"]) == (str(store), 3), how
        copy = tmp_path / f"copy-{how.replace(' ', '-')}"
        compacted = reported(
            run("compact", "--to", str(copy), "--json", *flags, env=env, home=home)
        )
        assert compacted["from"] == str(store), how
    assert not (home / ".local").exists()  # the per-user default store was never touched


def test_a_store_and_its_daemon_are_found_from_either(daemon: Daemon, tmp_path: Path) -> None:
    """Told only a data directory, a command finds the daemon serving it (its owner lock records
    the socket); told only a socket, the store it serves; told a pair that does not belong
    together, it refuses (exit 2)."""
    home = tmp_path / "home"
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, np.arange(2 * BT, dtype=np.uint32), [b"k" * 64] * 2)
    by_dir = reported(run("verify", "--json", "--data-dir", str(daemon.data_dir), home=home))
    assert (by_dir["mode"], by_dir["blocks"]) == ("online", 2)
    health = reported(run("health", "--json", "--data-dir", str(daemon.data_dir), home=home))
    assert (health["socket"], health["data_dir"]) == (str(daemon.socket), str(daemon.data_dir))
    by_socket = reported(run("verify", "--json", "--socket", str(daemon.socket), home=home))
    assert (by_socket["mode"], by_socket["path"]) == ("online", str(daemon.data_dir))
    purged = reported(
        run("purge", "--all", "--dry-run", "--json", "--socket", str(daemon.socket), home=home)
    )
    assert (purged["mode"], purged["blocks"]) == ("online", 2)

    elsewhere = tmp_path / "elsewhere"
    fill(elsewhere)
    mismatched = run(
        "verify", "--data-dir", str(elsewhere), "--socket", str(daemon.socket), home=home
    )
    assert mismatched.returncode == 2 and f"serves {daemon.data_dir}" in mismatched.stderr
    other_socket = run(
        "verify",
        "--data-dir",
        str(daemon.data_dir),
        "--socket",
        str(tmp_path / "other.sock"),
        home=home,
    )
    assert other_socket.returncode == 2 and f"served on {daemon.socket}" in other_socket.stderr


def test_print_config_is_a_file_config_accepts(tmp_path: Path) -> None:
    flags = [
        "--data-dir",
        str(tmp_path / "store"),
        "--socket",
        str(tmp_path / "s.sock"),
        "--tenant-ttls",
        "a=7d,b=90m",
        "--allowed-uids",
        "1000,1001",
        "--compression",
        "zstd",
        "--kv-events-tenants",
        'a "quoted" name',
    ]
    printed = run("serve", *flags, "--print-config")
    assert printed.returncode == 0, printed.stderr
    settings = tmp_path / "printed.toml"
    settings.write_text(printed.stdout)
    again = reported(run("serve", "--config", str(settings), "--print-config", "--json"))
    assert again == reported(run("serve", *flags, "--print-config", "--json"))
    assert again["tenant_ttls"] == ["a=7d", "b=90m"] and again["allowed_uids"] == [1000, 1001]


def test_verify_lists_problems_in_every_mode(tmp_path: Path) -> None:
    store = tmp_path / "store"
    data = [payload(2, i, 20_000) for i in range(4)]
    with Store.open(store, map_size=64 << 20) as opened:
        opened.put(IDENTITY, np.arange(4 * BT, dtype=np.uint32), data)
    corrupt_payload(store, data[2])
    for flags in ((), ("--fix",)):
        done = run("verify", "--json", "--data-dir", str(store), *flags)
        report = json.loads(done.stdout)
        assert isinstance(report["problems"], list) and len(report["problems"]) == 1, flags
        assert report["count"] == 1 and report["by_kind"] == {"payload": 1}, flags
    assert report["quarantined"] == 2 and report["remaining"] == []


@pytest.mark.parametrize(
    "args, code, says",
    [
        (("purge", "--all", "--older-than", "nan"), 2, "not a duration"),
        (("purge", "--all", "--older-than", "inf"), 2, "not a duration"),
        (("purge", "--all", "--older-than", "1e400"), 2, "not a duration"),
        (("serve", "--tenant-ttls", "a=nan", "--print-config"), 2, "tenant_ttls"),
        (("serve", "--durability", "foo", "--print-config"), 2, "durability"),
        (("stats", "--timeout", "0"), 2, "more than 0 seconds"),
        (("verify", "--data-dir", "{file}"), 1, "not a directory"),
        (("purge", "--all", "--data-dir", "{file}"), 1, "not a directory"),
        (("migrate", "up", "--data-dir", "{file}"), 1, "not a directory: give --data-dir"),
        (("migrate", "status", "--data-dir", "{file}"), 1, "not a directory"),
        (("compact", "--data-dir", "{store}", "--to", "{file}"), 1, "is not a directory"),
    ],
)
def test_bad_values_exit_2_and_nothing_ends_in_a_traceback(
    tmp_path: Path, args: tuple[str, ...], code: int, says: str
) -> None:
    afile = tmp_path / "a-file"
    afile.write_text("not a store")
    store = tmp_path / "store"
    fill(store)
    args = tuple(a.format(file=afile, store=store) for a in args)
    done = run(*args, home=tmp_path / "home")
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == code and says in done.stderr, done.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("purge", "--a"),  # would be --all: the whole store gone
        ("purge", "--tenant", "t", "--dry"),  # would be --dry-run
        ("migrate", "up", "--dry"),
        ("verify", "--no-pay"),
    ],
)
def test_an_abbreviated_flag_is_refused_not_guessed(tmp_path: Path, args: tuple[str, ...]) -> None:
    """A typo in a flag must not run something else (`purge --a` meant `--all`): exit 2, naming
    the flag, and the store untouched."""
    store = tmp_path / "store"
    fill(store)
    before = (store / "data.mdb").read_bytes()
    done = run(*args, "--json", "--data-dir", str(store))
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert f"unrecognized arguments: {args[-1]}" in done.stderr, done.stderr
    assert (store / "data.mdb").read_bytes() == before


def test_no_parser_of_the_command_takes_abbreviations() -> None:
    from prefixd.cli import parser

    def every(each: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
        yield each
        for action in each._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from every(child)

    parsers = list(every(parser()))
    assert len(parsers) > len(COMMANDS)
    assert [p.prog for p in parsers if p.allow_abbrev] == []


def test_a_reader_that_leaves_early_ends_no_traceback(tmp_path: Path) -> None:
    read, write = os.pipe()
    os.close(read)  # like `| head` that has gone: every write fails with EPIPE
    try:
        done = subprocess.run(
            [PREFIXD, "serve", "--print-config", "--data-dir", str(tmp_path)],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=DEADLINE_S,
            env=daemon_env(),
            check=False,
        )
    finally:
        os.close(write)
    assert done.stderr == "" and done.returncode == 1


def on_a_terminal(*args: str) -> tuple[int, str]:
    """Run with stderr on a pseudo-terminal; the exit code and what the terminal showed."""
    master, slave = pty.openpty()
    try:
        done = subprocess.run(
            [PREFIXD, *args],
            stdout=subprocess.DEVNULL,
            stderr=slave,
            timeout=DEADLINE_S,
            env=daemon_env(),
            check=False,
        )
    finally:
        os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 1 << 16)
        except OSError:  # EIO: the terminal's other end is closed and drained
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    return done.returncode, shown.decode(errors="replace")


def test_progress_only_on_a_terminal_and_not_when_quiet(tmp_path: Path) -> None:
    store = tmp_path / "store"
    fill(store, 4)
    code, shown = on_a_terminal("verify", "--data-dir", str(store))
    assert code == 0 and "verifying" in shown
    code, shown = on_a_terminal("compact", "--data-dir", str(store), "--to", str(tmp_path / "c"))
    assert code == 0 and "compacting" in shown
    code, shown = on_a_terminal("verify", "--quiet", "--data-dir", str(store))
    assert code == 0 and shown == ""
    piped = run("verify", "--data-dir", str(store))
    assert piped.returncode == 0 and piped.stderr == ""


def test_tables_keep_long_tenant_names_when_piped(daemon: Daemon) -> None:
    tenant = "tenant-" + "x" * 100
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        identity = make_identity(tenant=tenant)
        client.put(identity, np.arange(BT, dtype=np.uint32), [b"k" * 64])
    shown = run("stats", "--socket", str(daemon.socket))
    assert shown.returncode == 0 and tenant in shown.stdout, shown.stdout


def test_help_describes_the_tool_and_every_command() -> None:
    top = run("--help")
    assert top.returncode == 0 and "inference" in top.stdout and "Exit codes" in top.stdout
    for command in COMMANDS:
        assert f"\n    {command}" in top.stdout, command
    stats = run("stats", "--help")
    assert "--timeout SECONDS" in stats.stdout and "in seconds" in stats.stdout
    for command in ("stats", "health", "verify", "purge", "compact"):
        flags = run(command, "--help").stdout
        for flag in ("--config", "--data-dir", "--socket", "--json", "--quiet"):
            assert flag in flags, (command, flag)


def test_shell_completion_for_bash_and_zsh(tmp_path: Path) -> None:
    bash = run("completion", "bash")
    assert bash.returncode == 0 and "--data-dir" in bash.stdout and "verify" in bash.stdout
    script = tmp_path / "prefixd.bash"
    script.write_text(bash.stdout)
    checked = subprocess.run(
        ["bash", "-n", str(script)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stderr
    # sourced, the function completes the commands
    words = subprocess.run(
        [
            "bash",
            "-c",
            (
                f"source {script}; COMP_WORDS=(prefixd ver); COMP_CWORD=1; "
                '_shtab_prefixd; printf "%s\\n" "${COMPREPLY[@]}"'
            ),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert words.stdout.split() == ["verify"], words.stderr
    zsh = run("completion", "zsh")
    assert zsh.returncode == 0 and zsh.stdout.startswith("#compdef prefixd")
    if shutil.which("zsh"):
        zscript = tmp_path / "_prefixd"
        zscript.write_text(zsh.stdout)
        assert subprocess.run(["zsh", "-n", str(zscript)], check=False).returncode == 0


def test_a_refused_serve_leaves_no_store_behind(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    running = daemon_factory()
    taken = run("serve", "--data-dir", str(tmp_path / "a"), "--socket", str(running.socket))
    assert taken.returncode == 1 and "another daemon is serving" in taken.stderr
    assert not (tmp_path / "a").exists()
    a_file = running.socket.parent / "a-file.sock"
    a_file.write_text("")
    not_a_socket = run("serve", "--data-dir", str(tmp_path / "b"), "--socket", str(a_file))
    assert not_a_socket.returncode == 1 and "is not a socket" in not_a_socket.stderr
    assert not (tmp_path / "b").exists()
