"""No other local user can stand in for the daemon (prefixd.trust), tested as the attack: a second
uid (`nobody`, when the tests run as root) owns or may write the socket directory, or serves an
impostor socket; the daemon refuses to serve there, and the client sends it nothing."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixd.client import AsyncClient, Client
from prefixd.errors import UntrustedDaemonError

from ..waiting import wait_for
from .conftest import DaemonFactory

NOBODY = 65534

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root, to act as a second user (uid 65534)"
)


def refused_start(daemon_factory: DaemonFactory, **where: Path) -> str:
    daemon = daemon_factory(wait=False, **where)
    assert daemon.proc is not None
    assert daemon.proc.wait(60) != 0
    return daemon.log()


def test_a_socket_directory_another_user_made_is_refused(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    """The attack: the victim's fallback socket directory, made beforehand by another user."""
    taken = sock_dir / "prefixd-0"
    taken.mkdir()
    os.chown(taken, NOBODY, NOBODY)
    log = refused_start(daemon_factory, socket_path=taken / "prefixd.sock")
    assert "socket directory" in log and "belongs to uid 65534" in log
    assert not (taken / "prefixd.sock").exists()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_socket_directory_others_may_write_is_refused(
    daemon_factory: DaemonFactory, sock_dir: Path, mode: int
) -> None:
    shared = sock_dir / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    log = refused_start(daemon_factory, socket_path=shared / "prefixd.sock")
    assert "may be written by other users" in log


def test_a_data_directory_others_may_write_is_refused(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    os.chmod(data, 0o777)
    assert "data directory" in refused_start(daemon_factory, data_dir=data)
    os.chmod(data, 0o755)
    os.chown(data, NOBODY, NOBODY)
    assert "belongs to uid 65534" in refused_start(daemon_factory, data_dir=data)


@pytest.mark.parametrize("where", ["data_dir", "socket_path"])
def test_a_directory_another_user_could_move_away_is_refused(
    daemon_factory: DaemonFactory, tmp_path: Path, where: str
) -> None:
    """A private directory inside one others may write (without the sticky bit), or one another
    user owns: they could move it away and put their own store or socket in its place."""
    for mode, owner, says in ((0o777, 0, "may be written by other users"),
                              (0o755, NOBODY, "belongs to uid 65534")):  # fmt: skip
        shared = Path(tempfile.mkdtemp(dir=tmp_path))
        os.chmod(shared, mode)
        os.chown(shared, owner, owner)
        private = shared / "private"
        private.mkdir(mode=0o700)
        path = private if where == "data_dir" else private / "prefixd.sock"
        log = refused_start(daemon_factory, **{where: path})
        assert "the directory above it" in log and says in log, log


def test_a_store_whose_files_others_may_write_is_refused(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Another user who may write data.mdb could rewrite a block and its checksum both."""
    daemon = daemon_factory()
    daemon.stop()
    os.chmod(daemon.data_dir / "data.mdb", 0o666)
    log = refused_start(daemon_factory, data_dir=daemon.data_dir)
    assert "data.mdb may be written by other users" in log, log


IMPOSTOR = textwrap.dedent(
    """
    import os, socket, sys
    path, received = sys.argv[1], sys.argv[2]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o777)
    listener.listen(8)
    print("listening", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.settimeout(2)
        try:
            data = conn.recv(1 << 16)
        except OSError:
            data = b""
        with open(received, "ab") as out:
            out.write(data)
        conn.close()
    """
)


# The impostor runs as uid 65534, which cannot reach the test's own interpreter (under /root on
# our machines): the system's Python runs its few stdlib lines.
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture
def impostor() -> Iterator[tuple[Path, Path, subprocess.Popen[str]]]:
    """A listener run as uid 65534 in a directory of its own, recording what it receives."""
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip(f"{SYSTEM_PYTHON} is missing: nothing to run the second user's listener")
    home = Path(tempfile.mkdtemp(prefix="impostor", dir="/tmp"))
    os.chown(home, NOBODY, NOBODY)
    received = home / "received"
    command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    proc = subprocess.Popen(
        [*command, SYSTEM_PYTHON, "-c", IMPOSTOR, str(home / "prefixd.sock"), str(received)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        yield home / "prefixd.sock", received, proc
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(home, ignore_errors=True)


def test_the_client_sends_nothing_to_a_socket_another_user_serves(
    impostor: tuple[Path, Path, subprocess.Popen[str]],
) -> None:
    path, received, _ = impostor
    with pytest.raises(UntrustedDaemonError, match="belongs to uid 65534"):
        Client(path, region_bytes=1 << 20)
    assert not received.exists() or received.read_bytes() == b""


def test_the_client_checks_the_serving_process_too(
    impostor: tuple[Path, Path, subprocess.Popen[str]], sock_dir: Path
) -> None:
    """The impostor's socket moved into the victim's own directory and given to the victim:
    the file and its directory look right, the process behind it is still another user."""
    path, received, _ = impostor
    moved = sock_dir / "prefixd.sock"
    os.rename(path, moved)
    os.chown(moved, 0, 0)
    with pytest.raises(UntrustedDaemonError, match="runs as uid 65534"):
        Client(moved)

    async def connect() -> None:
        await AsyncClient.connect(moved)

    with pytest.raises(UntrustedDaemonError, match="runs as uid 65534"):
        asyncio.run(connect())
    # the impostor saw two connections come and go, with not one byte on them
    assert not received.exists() or received.read_bytes() == b""


def test_a_daemon_run_as_another_user_is_accepted_when_named(
    impostor: tuple[Path, Path, subprocess.Popen[str]],
) -> None:
    """`daemon_uid` names the daemon's user (a service account): then its socket passes the
    checks and the connection goes ahead (this listener is no daemon: it never answers)."""
    path, received, _ = impostor
    with pytest.raises(Exception) as refused:
        Client(path, timeout=1.0, daemon_uid=NOBODY)
    assert not isinstance(refused.value, UntrustedDaemonError)
    wait_for(lambda: received.exists() and received.read_bytes() != b"", "the hello to arrive")
