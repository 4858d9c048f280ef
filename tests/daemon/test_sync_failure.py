"""The daemon after a failed fsync: it refuses puts (`sync_failed`, through the socket), serves
reads, says so in `health`, its metrics and systemd's STATUS=, keeps its watchdog pings, and its
next start checks what was written since the last good sync.

The failure is injected in the daemon's own process: a launcher wraps the store's environment so
that its fsync fails as a disk's would (LMDB's EIO) while a trigger file exists, then runs the CLI.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.errors import StoreWriteError, SyncFailedError
from prefixd.store.sync_state import SYNC_MARKER

from .conftest import DEADLINE_S, IDENTITY, DaemonFactory, daemon_env, payload, wait_for
from .test_metrics import free_port, samples, scrape

BT = IDENTITY.block_tokens

LAUNCHER = """
import os, sys
import lmdb
from prefixd.store import store

TRIGGER = os.environ["TEST_FAIL_SYNC_FILE"]


class FailingSyncEnv:
    def __init__(self, env):
        self._env = env

    def sync(self, force=False):
        if os.path.exists(TRIGGER):
            raise lmdb.DiskError("mdb_env_sync: Input/output error")
        return self._env.sync(force)

    def __getattr__(self, name):
        return getattr(self._env, name)


opened = store.open_environment


def open_failing(*args, **kwargs):
    env, tables, meta = opened(*args, **kwargs)
    return FailingSyncEnv(env), tables, meta


store.open_environment = open_failing

from prefixd.cli import main

sys.exit(main(sys.argv[1:]))
"""


def tokens(i: int, n_blocks: int = 3) -> np.ndarray:
    return (np.arange(n_blocks * BT, dtype=np.uint32) + 400_000_000 + i * 1000).astype(np.uint32)


def payloads(i: int) -> list[bytes]:
    return [payload(i, b) for b in range(3)]


def sync_failed_gauge(port: int) -> float:
    return samples(scrape(port), "prefixd_store_sync_failed")[()]


def test_a_failed_fsync_refuses_puts_keeps_reads_is_reported_and_checked_at_the_next_start(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    launcher = tmp_path / "failing_sync.py"
    launcher.write_text(LAUNCHER)
    trigger = tmp_path / "fail-syncs"
    port = free_port()
    daemon = daemon_factory(
        "--sync-interval-s",
        "0.05",
        "--metrics-port",
        str(port),
        env={"TEST_FAIL_SYNC_FILE": str(trigger), "WATCHDOG_USEC": "200000"},
        launcher=[sys.executable, str(launcher)],
    )

    def pings() -> int:
        return sum(b"WATCHDOG=1" in m.split(b"\n") for m in daemon.since_start())

    def status_lines() -> list[bytes]:
        return [
            line
            for m in daemon.since_start()
            for line in m.split(b"\n")
            if line.startswith(b"STATUS=")
        ]

    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, tokens(0), payloads(0))
        assert client.health()["status"] == "ok"
        assert sync_failed_gauge(port) == 0

        trigger.touch()  # the disk fails the next fsync (the periodic sync's, within 0.05 s)
        wait_for(lambda: client.health()["status"] == "sync_failed", "health to report it")
        wait_for(lambda: sync_failed_gauge(port) == 1, "the metric to report it")
        wait_for(
            lambda: any(b"writes refused" in line for line in status_lines()),
            "a STATUS= line saying so",
        )
        assert b"Input/output error" in status_lines()[-1]
        stats = client.stats()
        assert stats["metrics"]["sync"]["failed"] is True
        checked = subprocess.run(
            [sys.executable, "-m", "prefixd", "health", "--socket", str(daemon.socket)],
            env=daemon_env(),
            capture_output=True,
            text=True,
            timeout=DEADLINE_S,
            check=False,
        )
        assert checked.returncode == 1, checked.stdout + checked.stderr  # a check that fails
        assert "sync_failed" in checked.stdout

        with pytest.raises(SyncFailedError) as refused:
            client.put(IDENTITY, tokens(1), payloads(1))
        assert isinstance(refused.value, StoreWriteError)
        assert refused.value.code == "sync_failed" and "refuses writes" in refused.value.message
        # reads go on, and the daemon is alive (pings go on: no restart behind the operator)
        assert client.lookup(IDENTITY, [tokens(0)])[0].n_blocks == 3
        assert [bytes(v) for v in client.load(IDENTITY, tokens(0)).views] == payloads(0)
        assert client.lookup(IDENTITY, [tokens(1)])[0].n_blocks == 0
        seen = pings()
        wait_for(lambda: pings() >= seen + 3, "watchdog pings to go on")

    trigger.unlink()  # the disk answers again: nothing changes until a restart
    assert daemon.stop() == 0, daemon.log()
    assert (daemon.data_dir / SYNC_MARKER).exists()

    daemon.start()
    log = daemon.logs[-1].read_text()
    assert "checked the 3 block(s) and 0 part(s) written since the last good sync" in log, log
    assert "all sound" in log
    assert not (daemon.data_dir / SYNC_MARKER).exists()
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert client.health()["status"] == "ok"
        assert sync_failed_gauge(port) == 0
        client.put(IDENTITY, tokens(1), payloads(1))
        assert [bytes(v) for v in client.load(IDENTITY, tokens(1)).views] == payloads(1)
        assert [bytes(v) for v in client.load(IDENTITY, tokens(0)).views] == payloads(0)


def test_retiring_a_model_is_skipped_once_an_fsync_failed(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """Retiring other versions of a model is a write: once an fsync failed it is skipped, so an
    engine that says what it serves still connects and reads, and a daemon with model manifests
    whose store opens failed (the disk still fails its fsyncs) still starts and serves."""
    launcher = tmp_path / "failing_sync.py"
    launcher.write_text(LAUNCHER)
    trigger = tmp_path / "fail-syncs"
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"v1")
    daemon = daemon_factory(
        "--sync-interval-s",
        "0.05",
        "--model-manifests",
        f"m={weights}",
        env={"TEST_FAIL_SYNC_FILE": str(trigger)},
        launcher=[sys.executable, str(launcher)],
    )
    with Client(daemon.socket, region_bytes=1 << 20, serves=[("m", "w")]) as client:
        client.put(IDENTITY, tokens(0), payloads(0))
        trigger.touch()  # the disk fails every fsync from now on
        wait_for(lambda: client.health()["status"] == "sync_failed", "health to report it")
    with Client(daemon.socket, region_bytes=1 << 20, serves=[("m", "w")]) as engine:
        assert engine.lookup(IDENTITY, [tokens(0)])[0].n_blocks == 3
    daemon.stop()
    daemon.start()  # opened failed: the manifests' retirement is skipped, reads go on
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        assert client.health()["status"] == "sync_failed"
        assert [bytes(v) for v in client.load(IDENTITY, tokens(0)).views] == payloads(0)
    trigger.unlink()
