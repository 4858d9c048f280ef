"""`prefixd verify`: offline with a progress bar, online through the daemon without stopping
service, `--fix` in both modes, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from prefixd import Store
from prefixd.client import Client

from ..store.test_faults import corrupt_payload
from .conftest import IDENTITY, REPO, Daemon, payload

BT = IDENTITY.block_tokens


def verify(*args: str) -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    done = subprocess.run(
        [sys.executable, "-m", "prefixd", "verify", "--json", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=env,
        check=False,
    )
    return done.returncode, json.loads(done.stdout) if done.stdout else {}, done.stderr


def test_offline_verify_reports_and_fixes(tmp_path: Path) -> None:
    path = tmp_path / "store"
    prompt = np.arange(6 * BT, dtype=np.uint32) + 41_000_000
    data = [payload(1, i, 20_000) for i in range(6)]
    with Store.open(path, map_size=64 << 20) as store:
        store.put(IDENTITY, prompt, data)
    corrupt_payload(path, data[4])
    code, report, stderr = verify("--data-dir", str(path))
    assert code == 1 and report["mode"] == "offline"
    assert report["by_kind"] == {"payload": 1} and report["count"] == 1
    assert stderr == ""  # no progress bar: stderr is no terminal
    code, report, _ = verify("--data-dir", str(path), "--fix")
    assert code == 0 and report["quarantined"] == 2 and report["remaining"] == []
    code, report, _ = verify("--data-dir", str(path))
    assert code == 0 and report["problems"] == [] and report["blocks"] == 4
    assert verify("--data-dir", str(path), "--fix", "--no-payloads")[0] == 2


def test_online_verify_while_serving(daemon: Daemon) -> None:
    prompt = np.arange(6 * BT, dtype=np.uint32) + 42_000_000
    data = [payload(2, i, 20_000) for i in range(6)]
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, prompt, data)
    daemon.restart()  # the pages are on disk, where the test damages them
    corrupt_payload(daemon.data_dir, data[3])
    where = ("--data-dir", str(daemon.data_dir), "--socket", str(daemon.socket))
    code, report, _ = verify(*where)
    assert code == 1 and report["mode"] == "online" and report["by_kind"] == {"payload": 1}
    code, report, _ = verify(*where, "--fix")
    assert code == 0 and report["quarantined"] == 3 and report["remaining"] == []
    with Client(daemon.socket, region_bytes=1 << 20) as client:  # still serving
        loaded = client.load(IDENTITY, prompt)
        assert loaded.n_blocks == 3 and [bytes(v) for v in loaded.views] == data[:3]
    assert verify(*where)[0] == 0


@pytest.mark.damages_store  # and a check in this process would die of it: LMDB aborts
def test_the_daemon_survives_verifying_pages_lmdb_cannot_read(
    daemon_factory, tmp_path: Path
) -> None:
    """A branch page pointing at a meta page makes LMDB abort the process that walks it: the
    daemon's check runs in a child, so the daemon reports the damage and goes on serving."""
    import struct

    import lmdb

    from ..store.test_corruption import PAGE, _point_branch_child

    path = tmp_path / "store"
    with Store.open(path, map_size=64 << 20) as store:
        for i in range(40):  # enough small records for the blocks table to need a branch page
            store.put(IDENTITY, np.arange(BT, dtype=np.uint32) + 50_000_000 + 10 * i, [b"x" * 48])
    env = lmdb.open(str(path), max_dbs=16, map_size=64 << 20, readonly=True, lock=False)
    with env.begin() as txn:
        db = txn.get(b"blocks")
    env.close()
    depth, root = struct.unpack_from("<H", db, 6)[0], struct.unpack_from("<Q", db, 40)[0]
    assert depth == 2 and PAGE == 4096
    _point_branch_child(path / "data.mdb", root, 0)
    daemon = daemon_factory(data_dir=path)
    code, report, _ = verify("--data-dir", str(path), "--socket", str(daemon.socket))
    assert code == 1 and report["mode"] == "online"
    assert report["by_kind"].get("pages") == 1, report
    code, report, _ = verify("--data-dir", str(path), "--socket", str(daemon.socket), "--fix")
    assert code == 1 and report["quarantined"] == 0  # nothing a repair could mend was touched
    with Client(daemon.socket) as client:
        assert client.health()["status"] == "ok"
