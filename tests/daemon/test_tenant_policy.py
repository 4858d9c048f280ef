"""Who may act for which tenant (prefixd.config.policy), tested as the attack: a second uid
(`nobody`, when the tests run as root) allowed on the socket reads, poisons, retires and purges
other tenants' entries. With a tenant policy every one of those is refused as `forbidden`,
naming the tenant, and counted; without one (a single-engine node) nothing changes, and the
daemon says so when other uids are allowed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixd.client import Client

from .conftest import IDENTITY, NOBODY, Daemon, DaemonFactory, as_nobody, make_identity

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root, to act as a second user (uid 65534)"
)

ALICE, BOB = make_identity(tenant="alice"), make_identity(tenant="bob")
PROMPT = np.arange(4 * IDENTITY.block_tokens, dtype=np.uint32) + 11
PAYLOADS = [b"alice's KV %d" % i for i in range(4)]


def start(daemon_factory: DaemonFactory, sock_dir: Path, *flags: str) -> Daemon:
    os.chmod(sock_dir, 0o711)  # nobody may reach the socket (and still not write the directory)
    daemon = daemon_factory("--allowed-uids", str(NOBODY), "--socket-mode", "0666", *flags)
    with Client(daemon.socket, region_bytes=1 << 20) as alice:
        alice.put(ALICE, PROMPT, PAYLOADS)
    return daemon


def lookup_alice(daemon: Daemon) -> Callable[[], Any]:
    return lambda: _with(daemon, lambda c: c.lookup(ALICE, [PROMPT])[0].n_blocks)


def _with(daemon: Daemon, use: Callable[[Client], Any], **options: Any) -> Any:
    with Client(daemon.socket, region_bytes=1 << 20, **options) as client:
        return use(client)


def test_without_a_policy_every_allowed_peer_may_use_every_tenant_and_serve_warns(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    daemon = start(daemon_factory, sock_dir)
    assert as_nobody(lookup_alice(daemon)) == ("ok", 4)  # unchanged: today's node keeps working
    assert "without a tenant policy" in daemon.log()


def test_a_policy_confines_a_peer_to_its_tenants(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    daemon = start(daemon_factory, sock_dir, "--tenant-policy", f"uid:{NOBODY}=bob")
    attacks: dict[str, Callable[[], Any]] = {
        "read alice": lookup_alice(daemon),
        "load alice": lambda: _with(daemon, lambda c: c.load(ALICE, PROMPT).n_blocks),
        "poison alice": lambda: _with(
            daemon, lambda c: c.put(ALICE, PROMPT[::-1].copy(), PAYLOADS).stored
        ),
        "list alice's prompts": lambda: _with(
            daemon, lambda c: len(c.hot(1 << 20, tenant="alice"))
        ),
        "purge alice": lambda: _with(daemon, lambda c: c.purge(tenant="alice")),
        "purge everything": lambda: _with(daemon, lambda c: c.purge(everything=True)),
        "retire other weights": lambda: _with(daemon, lambda c: 0, serves=[("m", "other")]),
        "verify": lambda: _with(daemon, lambda c: c.verify()),
    }
    for name, attack in attacks.items():
        kind, outcome = as_nobody(attack)
        assert kind == "error" and "may not" in outcome, (name, outcome)
    kind, outcome = as_nobody(lookup_alice(daemon))
    assert "may not use tenant 'alice'" in outcome
    # its own tenant works; alice's entries are all still there and hers
    assert as_nobody(lambda: _with(daemon, lambda c: c.put(BOB, PROMPT, PAYLOADS).stored)) == (
        "ok",
        4,
    )
    with Client(daemon.socket, region_bytes=1 << 20) as root:
        with root.load(ALICE, PROMPT) as loaded:
            assert [bytes(v) for v in loaded.views] == PAYLOADS
        assert root.stats()["server"]["errors.forbidden"] >= len(attacks)


def test_stats_show_a_confined_peer_only_its_own_tenants(
    daemon_factory: DaemonFactory, sock_dir: Path
) -> None:
    daemon = start(daemon_factory, sock_dir, "--tenant-policy", f"uid:{NOBODY}=bob")
    assert as_nobody(lambda: _with(daemon, lambda c: c.put(BOB, PROMPT, PAYLOADS).stored)) == (
        "ok",
        4,
    )
    kind, seen = as_nobody(lambda: _with(daemon, lambda c: sorted(c.stats()["metrics"]["tenants"])))
    assert (kind, seen) == ("ok", ["bob"])  # never alice's name, nor what she stores
    with Client(daemon.socket) as root:
        assert {"alice", "bob"} <= set(root.stats()["metrics"]["tenants"])


def test_grants_name_operations_and_groups(daemon_factory: DaemonFactory, sock_dir: Path) -> None:
    policy = f"uid:{NOBODY}=bob+op:hot,gid:{NOBODY}=alice"
    daemon = start(daemon_factory, sock_dir, "--tenant-policy", policy)
    assert as_nobody(lookup_alice(daemon)) == ("ok", 4)  # through its group
    kind, outcome = as_nobody(lambda: _with(daemon, lambda c: len(c.hot(1 << 20, tenant="alice"))))
    assert (kind, outcome) == ("ok", 1)
    kind, outcome = as_nobody(lambda: _with(daemon, lambda c: c.purge(tenant="alice")))
    assert "may not run purge" in outcome


def test_a_bad_policy_is_refused_at_start(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--tenant-policy", "uid:x=bob", wait=False)
    assert daemon.proc is not None and daemon.proc.wait(60) != 0
    assert "tenant_policy" in daemon.log()
