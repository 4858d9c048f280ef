"""A reload that takes rights away holds the connections already open to it, tested as the attack:
an engine of a second uid (`nobody`, when the tests run as root) that stays connected across the
reload. For each kind of grant (a uid or a group on the socket, a tenant of the policy by uid or by
group, an administrative operation) its next request is refused as `forbidden` and counted, and
the pins it held on what it lost are released: an eviction may take those blocks again. What it
keeps goes on working on the same connection."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from prefixd.client import Client
from prefixd.schema.keys import pack_keys

from .conftest import NOBODY, Daemon, DaemonFactory, held_as_nobody, wait_for
from .test_pins import BLOCK, ENGINE, SMALL, key

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root, to act as a second user (uid 65534)"
)

ALICE, BOB = (dataclasses.replace(ENGINE, tenant=t) for t in ("alice", "bob"))
GROUP = 4242  # a supplementary group of nobody's, in these tests only
BASE = 'socket_mode = "0666"\n'


def own(identity: Any) -> bytes:
    """The one block the tenant stores (its key differs from the other tenant's)."""
    return pack_keys(identity, [key(0 if identity.tenant == "alice" else 1)])


ACTIONS = {
    "pin alice": lambda c: c.lookup(ALICE, [own(ALICE)], pin=True)[0].n_blocks,
    "pin bob": lambda c: c.lookup(BOB, [own(BOB)], pin=True)[0].n_blocks,
    "lookup alice": lambda c: c.lookup(ALICE, [own(ALICE)])[0].n_blocks,
    "lookup bob": lambda c: c.lookup(BOB, [own(BOB)])[0].n_blocks,
    "verify": lambda c: c.verify() is not None,
}


def start(daemon_factory: DaemonFactory, sock_dir: Path, settings: Path, granted: str) -> Daemon:
    os.chmod(sock_dir, 0o711)  # nobody may reach the socket (and still not write the directory)
    settings.write_text(BASE + granted)
    daemon = daemon_factory("--config", str(settings), *SMALL)
    with Client(daemon.socket, region_bytes=4 << 20) as writer:
        for identity in (ALICE, BOB):
            writer.put(identity, own(identity), [b"\1" * BLOCK])
    return daemon


def evict_unpinned(daemon: Daemon) -> tuple[bool, bool]:
    """Fill the store past its capacity (every block not pinned goes); whether alice's and bob's
    block are still stored."""
    with Client(daemon.socket, region_bytes=4 << 20) as writer:
        for i in range(100, 140):
            writer.put(ENGINE, pack_keys(ENGINE, [key(i)]), [bytes([i]) * BLOCK])
        return tuple(  # type: ignore[return-value]
            writer.lookup(identity, [own(identity)])[0].n_blocks == 1 for identity in (ALICE, BOB)
        )


def server_counters(daemon: Daemon) -> dict[str, Any]:
    with Client(daemon.socket) as root:
        counters: dict[str, Any] = root.stats()["server"]
        return counters


def forbidden(outcome: tuple[str, Any], says: str) -> bool:
    kind, text = outcome
    return kind == "error" and text.startswith("ForbiddenError") and says in text


@pytest.mark.parametrize(
    ("granted", "groups"),
    [(f"allowed_uids = [{NOBODY}]\n", ()), (f"allowed_gids = [{GROUP}]\n", (GROUP,))],
    ids=["uid", "gid"],
)
def test_a_peer_taken_off_the_socket_is_refused_and_loses_its_pins(
    daemon_factory: DaemonFactory,
    sock_dir: Path,
    tmp_path: Path,
    granted: str,
    groups: tuple[int, ...],
) -> None:
    settings = tmp_path / "prefixd.toml"
    daemon = start(daemon_factory, sock_dir, settings, granted)
    with held_as_nobody(daemon.socket, ACTIONS, groups) as engine:
        assert engine("pin alice") == ("ok", 1)
        settings.write_text(BASE)
        daemon.reload()
        # its pin went with its admission, at the reload: the peer has not spoken since
        assert evict_unpinned(daemon) == (False, False)
        assert forbidden(engine("lookup bob"), "may no longer use this daemon")
        # then the connection closes, as at accept (the only one left: ours asking); a new one
        # is refused there
        wait_for(lambda: server_counters(daemon)["open_connections"] == 1, "the close")
        assert forbidden(engine("lookup bob"), "may not use this daemon")
    counters = server_counters(daemon)
    assert counters["revoked"] == 1 and counters["errors.forbidden"] >= 1
    assert counters["refused"] >= 1  # the new connection, at accept
    assert "a reload took its admission to the socket from the connection" in daemon.log()


@pytest.mark.parametrize("principal", [f"uid:{NOBODY}", f"gid:{GROUP}"])
def test_a_tenant_taken_from_a_grant_is_refused_on_the_open_connection(
    daemon_factory: DaemonFactory, sock_dir: Path, tmp_path: Path, principal: str
) -> None:
    settings = tmp_path / "prefixd.toml"
    peers = f"allowed_uids = [{NOBODY}]\n"
    daemon = start(
        daemon_factory, sock_dir, settings, peers + f'tenant_policy = ["{principal}=alice+bob"]\n'
    )
    with held_as_nobody(daemon.socket, ACTIONS, (GROUP,)) as engine:
        assert engine("pin alice") == ("ok", 1)
        assert engine("pin bob") == ("ok", 1)
        settings.write_text(BASE + peers + f'tenant_policy = ["{principal}=bob"]\n')
        daemon.reload()
        assert evict_unpinned(daemon) == (False, True)  # alice's pin released, bob's held
        assert forbidden(engine("lookup alice"), "may not use tenant 'alice'")
        assert engine("lookup bob") == ("ok", 1)  # the grant it keeps, on the same connection
        assert forbidden(engine("pin alice"), "may not use tenant 'alice'")
    counters = server_counters(daemon)
    assert counters["revoked"] == 1 and counters["errors.forbidden"] == 2
    assert "a reload took tenant(s) alice from the connection" in daemon.log()


def test_an_operation_taken_from_a_grant_is_refused_on_the_open_connection(
    daemon_factory: DaemonFactory, sock_dir: Path, tmp_path: Path
) -> None:
    settings = tmp_path / "prefixd.toml"
    peers = f"allowed_uids = [{NOBODY}]\n"
    daemon = start(
        daemon_factory,
        sock_dir,
        settings,
        peers + f'tenant_policy = ["uid:{NOBODY}=bob+op:verify"]\n',
    )
    with held_as_nobody(daemon.socket, ACTIONS) as engine:
        assert engine("verify") == ("ok", True)
        assert engine("pin bob") == ("ok", 1)
        settings.write_text(BASE + peers + f'tenant_policy = ["uid:{NOBODY}=bob"]\n')
        daemon.reload()
        assert forbidden(engine("verify"), "may not run verify")
        assert engine("lookup bob") == ("ok", 1)
        assert evict_unpinned(daemon) == (False, True)  # its tenant's pin is kept
    counters = server_counters(daemon)
    assert counters["revoked"] == 1 and counters["errors.forbidden"] == 1


def test_a_reload_that_takes_nothing_away_revokes_nothing(
    daemon_factory: DaemonFactory, sock_dir: Path, tmp_path: Path
) -> None:
    settings = tmp_path / "prefixd.toml"
    peers = f"allowed_uids = [{NOBODY}]\n"
    daemon = start(
        daemon_factory, sock_dir, settings, peers + f'tenant_policy = ["uid:{NOBODY}=bob"]\n'
    )
    with held_as_nobody(daemon.socket, ACTIONS) as engine:
        assert engine("pin bob") == ("ok", 1)
        settings.write_text(BASE + peers + f'tenant_policy = ["uid:{NOBODY}=alice+bob"]\n')
        daemon.reload()
        assert engine("lookup alice") == ("ok", 1)  # a grant given by a reload is taken at once
        assert evict_unpinned(daemon) == (False, True)
    assert server_counters(daemon).get("revoked", 0) == 0
