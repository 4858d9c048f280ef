"""The node as the shipped units and the README build it, on one machine, as root: the daemon as
its service user `prefixd` (socket 0660 prefixd:prefixd in /run/prefixd, 0750), root's CLI, an
engine whose user is in group prefixd, an unrelated user, an impostor, and several daemons.

The users and the FHS paths are the node's own, made for the test in a mount namespace: each
command runs under `unshare --mount`, with /etc/passwd, /etc/group, /run and /var/lib bound to the
test's files and directories, so the accounts resolve by name and the default paths are the real
ones (/run/prefixd/prefixd.sock) while the machine's own files are never read or written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.waiting import DEADLINE_S, wait_for

from .conftest import REPO, daemon_env
from .test_trust import IMPOSTOR

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: users, namespaces and mounts"),
    pytest.mark.skipif(
        shutil.which("unshare") is None or shutil.which("setpriv") is None,
        reason="unshare and setpriv (util-linux) are needed",
    ),
]

# The node's accounts, by name; their uids are far from any a Debian machine allocates.
USERS = {"prefixd": 64100, "engine": 64101, "stranger": 64102, "svc2": 64103}
# Supplementary groups: the engine is in the daemon's group (usermod -aG prefixd engine).
MEMBERS = {"prefixd": ["engine"], "svc2": ["engine"]}


@dataclass
class Node:
    """A node's files (passwd, group, /run, /var/lib) and the processes started on it."""

    root: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def command(self, argv: Sequence[str], user: str | None = None) -> list[str]:
        """`argv` on the node: in a mount namespace of its own that sees the node's files, as
        `user` (its uid, gid and supplementary groups from the node's /etc/group)."""
        binds = " && ".join(
            f"mount --bind {self.root / source} {target}"
            for source, target in (
                ("etc/passwd", "/etc/passwd"),
                ("etc/group", "/etc/group"),
                ("run", "/run"),
                ("var-lib", "/var/lib"),
            )
        )
        switch = ["setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups"] if user else []
        return [
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", binds + ' && exec "$@"', "sh", *switch, *argv,
        ]  # fmt: skip

    def run(
        self,
        argv: Sequence[str],
        user: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(argv, user),
            env=daemon_env(**(env or {})),
            cwd=self.root,
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            check=False,
        )

    def python(
        self, code: str, user: str | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Python `code` on the node, with this checkout's prefixd importable."""
        path = {"PYTHONPATH": str(REPO), **(env or {})}
        return self.run([sys.executable, "-c", textwrap.dedent(code)], user, path)

    def prefixd(
        self, *args: str, user: str | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """The CLI, as an operator types it."""
        path = {"PYTHONPATH": str(REPO), **(env or {})}
        return self.run([sys.executable, "-m", "prefixd", *args], user, path)

    def directory(self, path: str, owner: str, mode: int) -> Path:
        """A directory of the node (`/run/x`, `/var/lib/x`), as systemd makes StateDirectory=
        and RuntimeDirectory=."""
        host = self.host(path)
        host.mkdir(parents=True, exist_ok=True)
        os.chown(host, USERS[owner], USERS[owner])
        os.chmod(host, mode)
        return host

    def host(self, path: str) -> Path:
        """Where the node's `path` lies on the machine."""
        for prefix, source in (("/run/", "run"), ("/var/lib/", "var-lib")):
            if path.startswith(prefix):
                return self.root / source / path.removeprefix(prefix)
        raise ValueError(path)

    def serve(
        self, user: str, env: Mapping[str, str], *args: str, instance: str = ""
    ) -> subprocess.Popen[bytes]:
        """`prefixd serve` as systemd runs the unit (prefixd@INSTANCE.service with an instance):
        its user, its directories made and handed to it, their paths in STATE_DIRECTORY and
        RUNTIME_DIRECTORY; returns once the socket answers."""
        name = f"prefixd-{instance}" if instance else "prefixd"
        self.directory(f"/var/lib/{name}", user, 0o700)
        self.directory(f"/run/{name}", user, 0o750)
        unit_env = {
            "STATE_DIRECTORY": f"/var/lib/{name}",
            "RUNTIME_DIRECTORY": f"/run/{name}",
            "PYTHONPATH": str(REPO),
            **({"PREFIXD_INSTANCE": instance} if instance else {}),
            **env,
        }
        log = (self.root / f"{name}-{user}.log").open("wb")
        proc = subprocess.Popen(
            self.command([sys.executable, "-m", "prefixd", "serve", *args], user),
            env=daemon_env(**unit_env),
            cwd=self.root,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        self.procs.append(proc)
        sock = self.host(f"/run/{name}/prefixd.sock")
        wait_for(lambda: sock.is_socket() or proc.poll() is not None, f"{name}'s socket")
        assert proc.poll() is None, self.log(name, user)
        return proc

    def log(self, name: str, user: str) -> str:
        return (self.root / f"{name}-{user}.log").read_text(errors="replace")

    def stop(self, proc: subprocess.Popen[bytes]) -> int:
        proc.terminate()
        return proc.wait(DEADLINE_S)


@pytest.fixture(scope="module")
def node() -> Iterator[Node]:
    """The node's files: its accounts added to copies of the machine's passwd and group."""
    root = Path(tempfile.mkdtemp(prefix="pfx-node-", dir="/tmp"))
    os.chmod(root, 0o755)  # every user of the node passes through it (the Python, the repo)
    (root / "etc").mkdir()
    (root / "run").mkdir()
    (root / "var-lib").mkdir()
    passwd = Path("/etc/passwd").read_text().rstrip("\n").splitlines()
    group = Path("/etc/group").read_text().rstrip("\n").splitlines()
    for name, uid in USERS.items():
        passwd.append(f"{name}:x:{uid}:{uid}::/nonexistent:/usr/sbin/nologin")
        group.append(f"{name}:x:{uid}:{','.join(MEMBERS.get(name, []))}")
    (root / "etc" / "passwd").write_text("\n".join(passwd) + "\n")
    (root / "etc" / "group").write_text("\n".join(group) + "\n")
    made = Node(root)
    try:
        yield made
    finally:
        for proc in made.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def service(node: Node) -> subprocess.Popen[bytes]:
    """The node's daemon, as prefixd.service runs it: user and group prefixd, no flags."""
    return node.serve("prefixd", {})


SOCKET = "/run/prefixd/prefixd.sock"

ROUND_TRIP = """
    import numpy as np
    from prefixd import Identity
    from prefixd.client import Client
    identity = Identity(model="m", weights="w", tokenizer="t", template="c", rope="r",
                        kv_layout="bf16", block_tokens=4, tenant="{tenant}")
    tokens = np.arange(8, dtype=np.uint32) + 7
    blocks = [bytes([1]) * 64, bytes([2]) * 64]
    with Client("{socket}", region_bytes=1 << 20) as client:
        client.put(identity, tokens, blocks)
        [hit] = client.lookup(identity, [tokens])
        with client.load(identity, tokens) as loaded:
            assert [bytes(v) for v in loaded.views] == blocks
    print("round trip", hit.n_blocks)
"""


def test_root_cli_reaches_the_service_users_daemon_with_no_flag(
    node: Node, service: subprocess.Popen[bytes]
) -> None:
    health = node.prefixd("health", "--json")
    assert health.returncode == 0, health.stderr
    report = json.loads(health.stdout)
    assert report["socket"] == SOCKET and report["data_dir"] == "/var/lib/prefixd"
    stats = node.prefixd("stats", "--json")
    assert stats.returncode == 0, stats.stderr


def test_an_engine_in_the_daemons_group_stores_and_loads_with_no_flag(
    node: Node, service: subprocess.Popen[bytes]
) -> None:
    done = node.python(ROUND_TRIP.format(socket=SOCKET, tenant="engine"), user="engine")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["round", "trip", "2"]
    again = node.python(
        """
        import asyncio
        from prefixd.client import AsyncClient
        async def main():
            async with await AsyncClient.connect("/run/prefixd/prefixd.sock") as client:
                print((await client.health())["status"])
        asyncio.run(main())
        """,
        user="engine",
    )
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == "ok"


def test_an_unrelated_user_is_refused_saying_how_to_let_it_in(
    node: Node, service: subprocess.Popen[bytes]
) -> None:
    refused = node.python(
        f"""
        from prefixd.client import Client
        from prefixd.errors import DaemonUnavailableError
        try:
            Client("{SOCKET}")
        except DaemonUnavailableError as exc:
            print(exc)
        """,
        user="stranger",
    )
    assert refused.returncode == 0, refused.stderr
    assert "stranger may not enter the directory /run/prefixd (drwxr-x---" in refused.stdout
    assert "usermod -aG prefixd stranger" in refused.stdout
    cli = node.prefixd("health", "--socket", SOCKET, user="stranger")
    assert cli.returncode == 1
    [line] = cli.stderr.splitlines()  # one line, no traceback
    assert "usermod -aG prefixd" in line


@pytest.mark.parametrize("where", ["own", "sticky"])
def test_an_impostors_socket_is_refused_and_receives_nothing(
    node: Node, service: subprocess.Popen[bytes], where: str
) -> None:
    """Another ordinary user serves a socket, in a directory of their own or in a world-writable
    sticky one (/tmp): the engine, trusting the service user now, still sends it nothing."""
    home = node.directory(f"/run/impostor-{where}", "stranger", 0o755)
    if where == "sticky":
        os.chown(home, 0, 0)
        os.chmod(home, 0o1777)
    received = node.root / f"received-{where}"
    received.touch()
    os.chown(received, USERS["stranger"], USERS["stranger"])
    path = f"/run/impostor-{where}/prefixd.sock"
    listener = subprocess.Popen(
        node.command(
            [sys.executable, "-c", textwrap.dedent(IMPOSTOR), path, str(received)], "stranger"
        ),
        env=daemon_env(),
        stdout=subprocess.PIPE,
    )
    node.procs.append(listener)
    assert listener.stdout is not None and listener.stdout.readline().strip() == b"listening"
    try:
        for user in ("engine", None):  # the engine, and root
            refused = node.python(
                f"""
                from prefixd.client import Client
                from prefixd.errors import UntrustedDaemonError
                try:
                    Client("{path}", region_bytes=1 << 20)
                except UntrustedDaemonError as exc:
                    print(exc)
                """,
                user=user,
            )
            assert refused.returncode == 0, refused.stderr
            assert "belongs to uid 64102 (stranger)" in refused.stdout
            assert "not sending anything" in refused.stdout
        assert received.read_bytes() == b""
    finally:
        listener.kill()
        listener.wait()


def test_a_daemon_run_as_another_user_is_named_by_one_setting(node: Node) -> None:
    """svc2 is no account clients trust unless told: PREFIXD_DAEMON_USER tells every client and
    command at once, and a daemon started as another user than it names refuses to start."""
    daemon = node.serve("svc2", {}, instance="alt")
    sock = "/run/prefixd-alt/prefixd.sock"
    try:
        plain = node.python(ROUND_TRIP.format(socket=sock, tenant="t"), user="engine")
        assert plain.returncode != 0
        assert "PREFIXD_DAEMON_USER=svc2" in plain.stderr
        told = {"PREFIXD_DAEMON_USER": "svc2"}
        named = node.python(ROUND_TRIP.format(socket=sock, tenant="t"), user="engine", env=told)
        assert named.returncode == 0, named.stderr
        health = node.prefixd("health", "--json", env={**told, "PREFIXD_INSTANCE": "alt"})
        assert health.returncode == 0, health.stderr
        assert json.loads(health.stdout)["socket"] == sock
        flags = node.prefixd("stats", "--json", "--instance", "alt", "--daemon-user", "svc2")
        assert flags.returncode == 0, flags.stderr
        unnamed = node.prefixd("stats", "--instance", "alt")
        assert unnamed.returncode == 1
        assert "PREFIXD_DAEMON_USER=svc2" in unnamed.stderr
    finally:
        assert node.stop(daemon) == 0
    wrong = subprocess.run(
        node.command([sys.executable, "-m", "prefixd", "serve"], "prefixd"),
        env=daemon_env(
            PYTHONPATH=str(REPO),
            PREFIXD_DAEMON_USER="svc2",
            STATE_DIRECTORY="/var/lib/prefixd-alt",
            RUNTIME_DIRECTORY="/run/prefixd-alt",
        ),
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    assert wrong.returncode != 0
    assert "daemon_user is svc2, but this daemon runs as uid 64100" in wrong.stderr


def test_several_daemons_on_one_node_each_with_its_store(
    node: Node, service: subprocess.Popen[bytes]
) -> None:
    """prefixd@gpu0 and prefixd@gpu1 beside prefixd: each its own store and socket; commands
    name an instance with PREFIXD_INSTANCE (or --instance), clients with node_socket(NAME)."""
    gpus = [node.serve("prefixd", {}, instance=name) for name in ("gpu0", "gpu1")]
    try:
        for name, how in (("gpu0", {"PREFIXD_INSTANCE": "gpu0"}), ("gpu1", None)):
            flag = ("--instance", name) if how is None else ()
            health = node.prefixd("health", "--json", *flag, env=how)
            assert health.returncode == 0, health.stderr
            report = json.loads(health.stdout)
            assert report["data_dir"] == f"/var/lib/prefixd-{name}"
            assert report["socket"] == f"/run/prefixd-{name}/prefixd.sock"
        stored = node.python(
            ROUND_TRIP.format(socket="/run/prefixd-gpu0/prefixd.sock", tenant="gpu"), "engine"
        )
        assert stored.returncode == 0, stored.stderr
        counts = node.python(
            """
            import numpy as np
            from prefixd import Identity
            from prefixd.client import Client
            from prefixd.paths import node_socket
            identity = Identity(model="m", weights="w", tokenizer="t", template="c", rope="r",
                                kv_layout="bf16", block_tokens=4, tenant="gpu")
            tokens = np.arange(8, dtype=np.uint32) + 7
            for name in ("gpu0", "gpu1"):
                with Client(node_socket(name)) as client:
                    print(client.lookup(identity, [tokens])[0].n_blocks)
            """,
            "engine",
        )
        assert counts.returncode == 0, counts.stderr
        assert counts.stdout.split() == ["2", "0"]
        # the engine's own doctor, as its other commands do, finds the instance's daemon (the
        # engine's runtime directory its own, as a login gives it: none here)
        mine = {"XDG_RUNTIME_DIR": ""}
        doctor = node.prefixd("doctor", "--json", "--instance", "gpu1", user="engine", env=mine)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert json.loads(doctor.stdout)["socket"] == "/run/prefixd-gpu1/prefixd.sock"
    finally:
        for proc in gpus:
            assert node.stop(proc) == 0
