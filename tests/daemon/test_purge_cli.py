"""`prefixd purge` online (through a running daemon) and offline, and the purge operation."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from prefixd import Identity
from prefixd.client import Client
from prefixd.errors import PrefixdError
from prefixd.store import Store

from ..needles import Needles
from .conftest import Daemon

BASE = {
    "model": "m",
    "weights": "w1",
    "tokenizer": "t",
    "template": "c",
    "rope": "r",
    "kv_layout": "bf16",
    "block_tokens": 4,
    "tenant": "a",
}
PROMPT = np.arange(100, 120, dtype=np.uint32)


def ident(**changes: object) -> Identity:
    return Identity(**{**BASE, **changes})


def purge(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "prefixd",
            "purge",
            "--json",
            "--data-dir",
            str(daemon.data_dir),
            "--socket",
            str(daemon.socket),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def fill(client: Client, *identities: Identity) -> None:
    for identity in identities:
        client.put(identity, PROMPT, [b"k" * 50] * 5)


def test_online_tenant_purge_and_dry_run(daemon: Daemon) -> None:
    a, b = ident(), ident(tenant="b")
    with Client(daemon.socket, region_bytes=1 << 16) as client:
        fill(client, a, b)
        dry = purge(daemon, "--tenant", "a", "--dry-run")
        assert dry.returncode == 0, dry.stderr
        summary = json.loads(dry.stdout)
        assert (summary["mode"], summary["dry_run"], summary["blocks"]) == ("online", True, 5)
        assert client.lookup(a, [PROMPT])[0].n_blocks == 5
        done = purge(daemon, "--tenant", "a")
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert (summary["mode"], summary["blocks"], summary["identities"]) == ("online", 5, 1)
        assert summary["payload_bytes"] == 250
        assert client.lookup(a, [PROMPT])[0].n_blocks == 0
        assert client.lookup(b, [PROMPT])[0].n_blocks == 5
        assert client.load(b, PROMPT).n_blocks == 5


def test_online_model_retirement(daemon: Daemon) -> None:
    old, new = ident(weights="w1"), ident(weights="w2")
    with Client(daemon.socket, region_bytes=1 << 16) as client:
        fill(client, old, new)
        done = purge(daemon, "--model", "m", "--except-weights", "w2")
        assert done.returncode == 0 and json.loads(done.stdout)["blocks"] == 5, done.stderr
        assert client.lookup(old, [PROMPT])[0].n_blocks == 0
        assert client.lookup(new, [PROMPT])[0].n_blocks == 5


def test_a_version_to_keep_that_no_identity_holds_retires_nothing(daemon: Daemon) -> None:
    """A typo in --except-weights would keep nothing and retire the version in use too: the
    purge removes nothing and says so (exit 3), online and offline."""
    old, live = ident(weights="sha256-old"), ident(weights="sha256-live")
    with Client(daemon.socket, region_bytes=1 << 16) as client:
        fill(client, old, live)
        typo = purge(daemon, "--model", "m", "--except-weights", "sha256-lvie")
        assert typo.returncode == 3, typo.stderr
        assert json.loads(typo.stdout)["unknown"] == ["keep"]
        assert "version to keep (weights 'sha256-lvie') of model 'm'" in typo.stderr
        assert [client.lookup(i, [PROMPT])[0].n_blocks for i in (old, live)] == [5, 5]
    assert daemon.stop() == 0
    offline = purge(daemon, "--model", "m", "--except-weights", "sha256-lvie")
    assert offline.returncode == 3 and json.loads(offline.stdout)["blocks"] == 0, offline.stderr
    done = purge(daemon, "--model", "m", "--except-weights", "sha256-live")
    assert done.returncode == 0 and json.loads(done.stdout)["blocks"] == 5, done.stderr


def test_offline_purge_after_the_daemon_stopped(daemon: Daemon) -> None:
    a, b = ident(), ident(tenant="b")
    with Client(daemon.socket, region_bytes=1 << 16) as client:
        fill(client, a, b)
    assert daemon.stop() == 0
    done = purge(daemon, "--all")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["mode"], summary["blocks"]) == ("offline", 10)
    with Store.open(daemon.data_dir, create=False) as store:
        assert store.stats().blocks == 0 and store.check() == []


def test_bad_arguments_exit_2(daemon: Daemon) -> None:
    for args in (
        (),
        ("--except-weights", "w2"),
        ("--tenant", "a", "--all"),
        ("--older-than", "soon"),
    ):
        out = purge(daemon, *args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.startswith("prefixd:")


def test_the_purge_operation_checks_its_fields(daemon: Daemon) -> None:
    with Client(daemon.socket) as client:
        for criteria in ({"tenant": 7}, {"keep": {"weights": "x"}}, {"colour": "red"}, {}):
            try:
                client.purge(**criteria)
            except PrefixdError as exc:
                assert exc.code == "bad_request"
            else:
                raise AssertionError(f"{criteria} was accepted")
        assert client.health()["status"] == "ok"


def test_share_groups_through_the_daemon(daemon_factory) -> None:
    daemon = daemon_factory("--share-groups", "labs=a+b")
    with Client(daemon.socket, region_bytes=1 << 16) as client:
        fill(client, ident(tenant="a"))
        assert client.lookup(ident(tenant="b"), [PROMPT])[0].n_blocks == 5
        assert client.lookup(ident(tenant="c"), [PROMPT])[0].n_blocks == 0
        for call in (
            lambda: client.lookup(ident(tenant="share:labs"), [PROMPT]),
            lambda: client.put(ident(tenant="share:labs"), PROMPT, [b"x"]),
        ):
            try:
                call()
            except PrefixdError as exc:
                assert exc.code == "bad_identity" and "reserved" in exc.message
            else:
                raise AssertionError("a reserved tenant name was accepted")
        assert client.health()["status"] == "ok"


def test_an_engine_declaring_its_version_retires_the_others(daemon: Daemon) -> None:
    old, new = ident(weights="w1"), ident(weights="w2")
    with Client(daemon.socket, region_bytes=1 << 16) as client:
        fill(client, old)
    with Client(daemon.socket, region_bytes=1 << 16, serves=[("m", "w2")]) as engine:
        assert engine.server["retired"] == 5
        assert engine.lookup(old, [PROMPT])[0].n_blocks == 0
        fill(engine, new)
        assert engine.lookup(new, [PROMPT])[0].n_blocks == 5
    try:
        Client(daemon.socket, serves=[("m", "")])
    except PrefixdError as exc:
        assert exc.code == "bad_request" and "serves[0]" in exc.message
    else:
        raise AssertionError("an empty weights version was accepted")


def fill_with_needles(client: Client, needles: Needles, victim: Identity, other: Identity) -> list:
    """Interleaved puts of both tenants, the victim's planted; the other's (tokens, payloads)."""
    kept = []
    for n in range(20):
        size = (700, 3000, 9000)[n % 3]
        client.put(victim, needles.tokens(victim, 3), needles.payloads(3, size))
        tokens = needles.tokens(other, 3, planted=False)
        payloads = needles.payloads(3, size, planted=False)
        client.put(other, tokens, payloads)
        kept.append((tokens, payloads))
    return kept


def loads_exactly(client: Client, identity: Identity, tokens: np.ndarray, payloads: list) -> bool:
    with client.load(identity, tokens) as loaded:
        return [bytes(view) for view in loaded.views] == payloads


def test_an_online_tenant_purge_leaves_no_byte_in_any_file(daemon: Daemon) -> None:
    needles = Needles(seed=21)
    victim, other = ident(tenant=needles.name("online-victim-42aa")), ident(tenant="b")
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        kept = fill_with_needles(client, needles, victim, other)
        done = purge(daemon, "--tenant", victim.tenant)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["blocks"] == 60
        assert needles.found(daemon.data_dir) == {}
        assert all(loads_exactly(client, other, t, p) for t, p in kept)


def test_an_offline_tenant_purge_leaves_no_byte_in_any_file(daemon: Daemon) -> None:
    needles = Needles(seed=22)
    victim, other = ident(tenant=needles.name("offline-victim-42ab")), ident(tenant="b")
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        kept = fill_with_needles(client, needles, victim, other)
    assert daemon.stop() == 0
    assert needles.found(daemon.data_dir)["data.mdb"] > 0  # the scan finds them
    done = purge(daemon, "--tenant", victim.tenant)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert (summary["mode"], summary["blocks"]) == ("offline", 60)
    assert needles.found(daemon.data_dir) == {}
    assert summary["cleared"]["complete"]
    with Store.open(daemon.data_dir, create=False) as store:
        for tokens, payloads in kept:
            out = bytearray(sum(map(len, payloads)))
            loaded = store.load(other, tokens, out)
            assert [bytes(out[o : o + n]) for o, n in zip(loaded.offsets, loaded.sizes)] == payloads


def test_an_engine_retiring_a_version_clears_it_with_scrub_retired(daemon_factory) -> None:
    daemon = daemon_factory("--scrub-retired", "true")
    needles = Needles(seed=23)
    old, new = ident(weights="w1"), ident(weights="w2")
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        kept = fill_with_needles(client, needles, old, new)
    with Client(daemon.socket, region_bytes=1 << 20, serves=[("m", "w2")]) as engine:
        assert engine.server["retired"] == 60
        assert needles.found(daemon.data_dir) == {}
        assert all(loads_exactly(engine, new, t, p) for t, p in kept)
