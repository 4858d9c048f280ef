"""Where stores live unless told (prefixd.paths): the service user's commands, run outside
systemd (no STATE_DIRECTORY), mean the node's store, the one its units keep in /var/lib."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from prefixd import paths
from prefixd.paths import default_data_dir

SERVICE = 4242


@pytest.fixture
def service_user(monkeypatch: pytest.MonkeyPatch) -> None:
    """An account named `prefixd` (uid SERVICE), whatever this machine's accounts are."""
    real = pwd.getpwnam

    def getpwnam(name: str) -> pwd.struct_passwd:
        if name != paths.SERVICE_USER:
            return real(name)
        return pwd.struct_passwd(
            (name, "x", SERVICE, SERVICE, "", "/var/lib/prefixd", "/usr/sbin/nologin")
        )

    monkeypatch.setattr(pwd, "getpwnam", getpwnam)


def test_the_service_users_store_is_the_nodes_without_systemd(
    service_user: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: SERVICE)
    home = {"HOME": "/var/lib/prefixd"}
    assert default_data_dir(home) == Path("/var/lib/prefixd")
    assert default_data_dir(home, "gpu0") == Path("/var/lib/prefixd-gpu0")
    assert default_data_dir({**home, "STATE_DIRECTORY": "/srv/kv"}) == Path("/srv/kv")


def test_other_users_keep_their_own_store(
    service_user: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: SERVICE + 1)
    assert default_data_dir({"HOME": str(tmp_path)}) == tmp_path / ".local/state/prefixd"
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert default_data_dir({"HOME": str(tmp_path)}) == Path("/var/lib/prefixd")
