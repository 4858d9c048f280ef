"""`prefixd doctor`: a node checked from an engine's point of view, as the installed command.

A healthy node passes every check (and keeps nothing of the round trip); a missing socket fails
reach; a user the daemon does not let in (run as root with --as-user 65534) fails reach or the
daemon's acceptance, a tenant its policy does not grant fails the tenant check, an impostor's
socket fails trust and receives nothing; each failure says how to fix it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from prefixd.client import Client

from ..daemon.conftest import NOBODY, Daemon, DaemonFactory, daemon_env
from ..waiting import DEADLINE_S

PREFIXD = str(Path(sys.executable).parent / "prefixd")  # the installed console script
CHECKS = ("reach", "trust", "accept", "tenant", "round_trip", "region")  # in this order
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to check as uid 65534")


def doctor(*args: str) -> tuple[int, dict[str, Any]]:
    """`prefixd doctor --json ARGS` with no PREFIXD_* of ours: its exit code and report."""
    done = subprocess.run(
        [PREFIXD, "doctor", "--json", "--region-bytes", "8MiB", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=daemon_env(),
        stdin=subprocess.DEVNULL,
    )
    assert done.stdout, done.stderr
    return done.returncode, json.loads(done.stdout)


def outcomes(report: dict[str, Any]) -> dict[str, bool | None]:
    return {c["name"]: c["ok"] for c in report["checks"]}


def check(report: dict[str, Any], name: str) -> dict[str, Any]:
    found: list[dict[str, Any]] = [c for c in report["checks"] if c["name"] == name]
    assert len(found) == 1, report
    return found[0]


def test_a_healthy_node_passes_every_check_and_keeps_nothing(daemon: Daemon) -> None:
    code, report = doctor("--socket", str(daemon.socket))
    assert code == 0, report
    assert report["ok"] is True and list(outcomes(report)) == list(CHECKS)
    assert all(outcomes(report).values())
    assert "the same bytes" in check(report, "round_trip")["detail"]
    region = check(report, "region")
    assert region["measured"]["region_bytes"] == 8 << 20 and region["measured"]["seconds"] > 0
    assert "8 MiB" in region["detail"]
    with Client(daemon.socket) as client:
        assert client.stats()["store"]["blocks"] == 0  # the throwaway blocks were deleted
    text = subprocess.run(
        [PREFIXD, "doctor", "--socket", str(daemon.socket), "--region-bytes", "1MiB"],
        check=False,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        env=daemon_env(),
    )
    assert text.returncode == 0 and "every check passed" in text.stdout


def test_a_missing_socket_fails_reach_and_says_to_start_the_daemon(tmp_path: Path) -> None:
    code, report = doctor("--socket", str(tmp_path / "run" / "prefixd.sock"))
    assert code == 1 and report["ok"] is False
    reach = check(report, "reach")
    assert reach["ok"] is False and "systemctl start prefixd.socket" in reach["fix"]
    assert [c["ok"] for c in report["checks"][1:]] == [None] * (len(CHECKS) - 1)


def test_an_impostors_socket_fails_trust_and_receives_nothing(tmp_path: Path) -> None:
    path = tmp_path / "prefixd.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()
    flags = ["--socket", str(path)]
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)  # root trusts root: the socket must be another's
    else:
        flags += ["--daemon-user", str(NOBODY)]
    code, report = doctor(*flags)
    assert code == 1 and outcomes(report)["reach"] is True
    trust = check(report, "trust")
    assert trust["ok"] is False and "not sending anything" in trust["detail"]
    assert "PREFIXD_DAEMON_USER" in trust["detail"] + trust["fix"]
    listener.settimeout(DEADLINE_S)
    reached, _ = listener.accept()  # the reach check's bare connection, closed at once
    reached.settimeout(DEADLINE_S)
    assert reached.recv(1024) == b""
    reached.close()
    listener.close()


@root_only
def test_as_a_user_the_daemon_does_not_let_in_reach_or_acceptance_fails_with_the_fix(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    daemon = daemon_factory("--socket-mode", "0666")
    code, report = doctor("--socket", str(daemon.socket), "--as-user", str(NOBODY))
    assert code == 1 and report["user"] == "nobody" and report["uid"] == NOBODY
    reach = check(report, "reach")  # the socket's directory is root's, 0700
    assert (
        reach["ok"] is False and f"nobody may not enter the directory {sock_dir}" in reach["detail"]
    )
    assert "usermod -aG" in reach["fix"]

    os.chmod(sock_dir, 0o711)  # nobody reaches the socket; the daemon still does not allow it
    code, report = doctor("--socket", str(daemon.socket), "--as-user", "nobody")
    assert code == 1
    assert outcomes(report)["reach"] is True and outcomes(report)["trust"] is True
    accept = check(report, "accept")
    assert accept["ok"] is False and "may not use this daemon" in accept["detail"]
    assert "usermod -aG" in accept["fix"] and "allowed_uids" in accept["fix"]
    assert outcomes(report)["round_trip"] is None


@root_only
def test_a_tenant_the_policy_does_not_grant_fails_the_tenant_check(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    os.chmod(sock_dir, 0o711)
    daemon = daemon_factory(
        "--socket-mode",
        "0666",
        "--allowed-uids",
        str(NOBODY),
        "--tenant-policy",
        f"uid:{NOBODY}=bob",
    )
    flags = ("--socket", str(daemon.socket), "--as-user", "nobody")
    code, report = doctor(*flags, "--tenant", "alice")
    assert code == 1 and outcomes(report)["accept"] is True
    tenant = check(report, "tenant")
    assert tenant["ok"] is False and "alice" in tenant["detail"]
    assert f"uid:{NOBODY}=alice" in tenant["fix"] and "tenant_policy" in tenant["fix"]
    code, report = doctor(*flags, "--tenant", "bob")
    assert code == 0, report
