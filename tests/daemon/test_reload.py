"""SIGHUP (systemctl reload) reloads what may change while the daemon serves, from the settings
file it started with; the rest waits for a restart, and a file that does not parse changes
nothing."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.daemon.watchers import fingerprint

from .conftest import NOBODY, DaemonFactory, as_nobody, make_identity

PROMPT = np.arange(4 * make_identity().block_tokens, dtype=np.uint32) + 5
ALICE, BOB, CAROL = (make_identity(tenant=t) for t in ("alice", "bob", "carol"))
BASE = 'socket_mode = "0666"\n'


def lookup(identity: object, socket: Path) -> int:
    with Client(socket) as client:
        return client.lookup(identity, [PROMPT])[0].n_blocks


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to act as a second user (uid 65534)")
def test_sighup_reloads_peers_and_tenancy(
    daemon_factory: DaemonFactory, sock_dir: Path, tmp_path: Path
) -> None:
    os.chmod(sock_dir, 0o711)  # nobody may reach the socket
    settings = tmp_path / "prefixd.toml"
    settings.write_text(BASE)
    daemon = daemon_factory("--config", str(settings))
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        for identity in (ALICE, BOB, CAROL):
            client.put(identity, PROMPT, [b"kv %d" % i for i in range(4)])
    assert as_nobody(lambda: lookup(ALICE, daemon.socket))[0] == "error"  # not allowed yet

    settings.write_text(
        BASE
        + f"allowed_uids = [{NOBODY}]\n"
        + f'tenant_policy = ["uid:{NOBODY}=alice"]\n'
        + 'tenant_ttls = ["carol=1ms"]\n'
        + "workers = 2\n"  # not while serving: at the next restart
    )
    daemon.reload()
    assert as_nobody(lambda: lookup(ALICE, daemon.socket)) == ("ok", 4)
    kind, outcome = as_nobody(lambda: lookup(BOB, daemon.socket))
    assert kind == "error" and "bob" in outcome  # the policy came with the reload
    assert lookup(CAROL, daemon.socket) == 0  # put before the reload, more than 1 ms ago
    assert lookup(BOB, daemon.socket) == 4
    log = daemon.log()
    assert "reloaded: allowed_uids, tenant_policy, tenant_ttls" in log
    assert "take effect at the next restart: workers" in log
    with Client(daemon.socket) as client:
        assert client.stats()["server"]["reloads"] == 1


def test_a_reload_that_does_not_parse_changes_nothing(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    settings = tmp_path / "prefixd.toml"
    settings.write_text('tenant_ttls = ["alice=7d"]\n')
    daemon = daemon_factory("--config", str(settings))
    settings.write_text('tenant_ttls = ["alice=nan"]\n')
    daemon.reload()
    assert "reload refused, the settings in force stay" in daemon.log()
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(ALICE, PROMPT, [b"kv"] * 4)
        assert client.lookup(ALICE, [PROMPT])[0].n_blocks == 4
        server = client.stats()["server"]
        assert (server["reloads"], server["reloads_refused"]) == (0, 1)


def test_a_reload_watches_new_model_manifests(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """A model listed by a reload is fingerprinted and its other versions retired at once."""
    models = tmp_path / "models"
    models.mkdir()
    manifest = models / "config.json"
    manifest.write_text('{"layers": 2}')
    settings = tmp_path / "prefixd.toml"
    settings.write_text("")
    daemon = daemon_factory("--config", str(settings))
    served = asyncio.run(fingerprint((manifest,)))
    old, new = make_identity(weights="sha256:old"), make_identity(weights=served)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        for identity in (old, new):
            client.put(identity, PROMPT, [b"kv"] * 4)
    model = old.model
    settings.write_text(f'model_manifests = ["{model}={manifest}"]\n')
    daemon.reload()
    with Client(daemon.socket) as client:
        assert client.server["models"] == {model: served}
        assert client.lookup(old, [PROMPT])[0].n_blocks == 0
        assert client.lookup(new, [PROMPT])[0].n_blocks == 4


def test_a_reload_that_cannot_be_applied_whole_changes_nothing(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """A model manifest that cannot be watched (a file where its directory should be) refuses the
    whole reload: the tenancy it changed too stays as it was, and the counters and the log say so.
    A file that is not UTF-8 is refused the same way."""
    settings = tmp_path / "prefixd.toml"
    settings.write_text('tenant_ttls = ["alice=7d"]\n')
    daemon = daemon_factory("--config", str(settings))
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(ALICE, PROMPT, [b"kv"] * 4)  # before the reloads: a 1 ms time to live ends it
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file")
    settings.write_text(f'tenant_ttls = ["alice=1ms"]\nmodel_manifests = ["m={blocker}/c.json"]\n')
    daemon.reload()
    settings.write_bytes(b'tenant_ttls = ["alice=1ms"]  # caf\xe9\n')
    daemon.reload()
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert client.lookup(ALICE, [PROMPT])[0].n_blocks == 4  # no time to live of 1 ms
        server = client.stats()["server"]
        assert (server["reloads"], server["reloads_refused"]) == (0, 2)
    assert daemon.log().count("reload refused, the settings in force stay") == 2
