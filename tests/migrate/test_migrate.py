"""Migrations: status, dry runs, the frozen version-1 fixture, crash resumption, refusals."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.errors import SchemaVersionError, StoreBusyError, SyncFailedError
from prefixd.migrate import Migrator
from prefixd.schema.meta import SCHEMA_VERSION, StoreMeta, with_version
from prefixd.schema.records import AccessRecord
from prefixd.store.environment import OwnerLock
from prefixd.store.sync_state import SYNC_MARKER

FIXTURE = Path(__file__).parent.parent / "fixtures" / "store-v1"
MANIFEST = json.loads((FIXTURE / "manifest.json").read_text())
V1_ACCESS = struct.Struct("<Q")


def copy_fixture(tmp_path: Path, name: str) -> Path:
    target = tmp_path / name
    shutil.copytree(FIXTURE / name, target)
    return target


def raw_tables(path: Path) -> tuple[lmdb.Environment, lmdb._Database, lmdb._Database]:
    env = lmdb.open(str(path), max_dbs=16)
    return env, env.open_db(b"meta"), env.open_db(b"access")


def access_values(path: Path) -> dict[bytes, bytes]:
    env, _, access = raw_tables(path)
    with env.begin(db=access) as txn:
        values = {bytes(k): bytes(v) for k, v in txn.cursor()}
    env.close()
    return values


def set_version(path: Path, version: int) -> None:
    env, meta_db, _ = raw_tables(path)
    with env.begin(write=True, db=meta_db) as txn:
        meta = StoreMeta.decode(txn.get(b"meta"), supported=None)
        txn.put(b"meta", with_version(meta, version).encode())
    env.close()


def write_as_version_1(path: Path) -> None:
    """Turn a current store into what version 1 wrote (only the access records differ)."""
    env, meta_db, access = raw_tables(path)
    with env.begin(write=True) as txn:
        cursor = txn.cursor(db=access)
        for key, value in list(cursor):
            txn.put(bytes(key), V1_ACCESS.pack(AccessRecord.decode(value).last_ns), db=access)
        meta = StoreMeta.decode(txn.get(b"meta", db=meta_db))
        txn.put(b"meta", with_version(meta, 1).encode(), db=meta_db)
        counters_db = env.open_db(b"counters", txn=txn)
        for key in [bytes(k) for k in txn.cursor(db=counters_db).iternext(values=False)]:
            if key.startswith(b"identity_stored:"):  # version 3's, absent in version 1
                txn.delete(key, db=counters_db)
    env.close()


def digest(path: Path) -> str:
    return hashlib.sha256((path / "data.mdb").read_bytes()).hexdigest()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prefixd", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# --- status --------------------------------------------------------------------------------------


def test_status_of_a_fresh_store(tmp_path: Path) -> None:
    Store.open(tmp_path / "s").close()
    status = Migrator(tmp_path / "s").status()
    assert (status.version, status.target, status.pending) == (SCHEMA_VERSION, SCHEMA_VERSION, ())


def test_status_of_the_version_1_fixture(tmp_path: Path) -> None:
    path = copy_fixture(tmp_path, "none")
    status = Migrator(path).status()
    assert status.version == 1 and [m.version for m in status.pending] == [2, 3, 4, 5]
    out = cli("migrate", "status", "--data-dir", str(path))
    assert out.returncode == 0 and json.loads(out.stdout)["pending"][0]["version"] == 2


def test_a_store_ahead_of_the_code_is_refused_everywhere(tmp_path: Path) -> None:
    Store.open(tmp_path / "s").close()
    set_version(tmp_path / "s", SCHEMA_VERSION + 1)
    with pytest.raises(SchemaVersionError, match="upgrade prefixd"):
        Store.open(tmp_path / "s")
    with pytest.raises(SchemaVersionError, match="upgrade prefixd"):
        Migrator(tmp_path / "s").status()
    for args in (("migrate", "up"), ("migrate", "status"), ("verify",)):
        out = cli(*args, "--data-dir", str(tmp_path / "s"))
        assert out.returncode == 1 and "upgrade prefixd" in out.stderr, out.stderr


def test_a_store_behind_the_code_is_refused_with_the_command_to_run(tmp_path: Path) -> None:
    path = copy_fixture(tmp_path, "none")
    with pytest.raises(SchemaVersionError) as caught:
        Store.open(path)
    assert caught.value.found == 1 and "prefixd migrate up --data-dir" in str(caught.value)
    out = cli("serve", "--data-dir", str(path), "--socket", str(tmp_path / "x.sock"))
    assert out.returncode == 1
    assert f"prefixd migrate up --data-dir {path}" in out.stderr
    assert not (tmp_path / "x.sock").exists()


# --- dry run and upgrade --------------------------------------------------------------------------


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    path = copy_fixture(tmp_path, "zstd")
    before = digest(path)
    report = Migrator(path).upgrade(dry_run=True)
    assert report.dry_run and report.steps[0].would_change == report.steps[0].examined > 0
    assert report.steps[0].changed == 0
    out = cli("migrate", "up", "--dry-run", "--data-dir", str(path))
    assert out.returncode == 0 and json.loads(out.stdout)["dry_run"] is True
    assert digest(path) == before
    assert Migrator(path).status().version == 1


@pytest.mark.parametrize("name", ["none", "zstd", "zstd-planes"])
def test_up_migrates_the_fixture_bit_identically(tmp_path: Path, name: str) -> None:
    path = copy_fixture(tmp_path, name)
    old_access = {k: V1_ACCESS.unpack(v)[0] for k, v in access_values(path).items()}
    out = cli("migrate", "up", "--data-dir", str(path), "--backup", str(tmp_path / "backup"))
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["from_version"], report["to_version"]) == (1, SCHEMA_VERSION)
    assert report["steps"][0]["changed"] == len(old_access)
    assert Migrator(tmp_path / "backup").status().version == 1  # the backup is the old store
    new_access = {k: AccessRecord.decode(v) for k, v in access_values(path).items()}
    assert {k: a.last_ns for k, a in new_access.items()} == old_access
    assert all(a.hits == 0 for a in new_access.values())
    with Store.open(path, create=False) as store:
        assert store.check() == []
        entries = [e for e in MANIFEST if e["store"] == name]
        assert sum(len(e["payload_sha256"]) for e in entries) == store.stats().blocks
        for entry in entries:
            identity = Identity.from_dict(entry["identity"])
            tokens = np.array(entry["tokens"], dtype=np.uint32)
            out_buffer = bytearray(1 << 20)
            loaded = store.load(identity, tokens, out_buffer)
            assert loaded.n_blocks == len(entry["payload_sha256"])
            for offset, size, expected in zip(
                loaded.offsets, loaded.sizes, entry["payload_sha256"]
            ):
                assert hashlib.sha256(out_buffer[offset : offset + size]).hexdigest() == expected
        store.sync()
        first = store.longest_prefix(identity, tokens).hashes[0]
        info = store.block_info(first)
        assert info is not None and info.hits >= 1  # the new field works after migrating
    assert Migrator(path).status().pending == ()
    again = cli("migrate", "up", "--data-dir", str(path))  # nothing left: a no-op
    assert again.returncode == 0 and json.loads(again.stdout)["steps"] == []


def test_up_refuses_a_store_a_daemon_holds(tmp_path: Path) -> None:
    path = copy_fixture(tmp_path, "none")
    holder = OwnerLock(path)
    try:
        with pytest.raises(StoreBusyError, match="stop it first"):
            Migrator(path).upgrade()
        with pytest.raises(StoreBusyError):
            Migrator(path).upgrade(dry_run=True)
        out = cli("migrate", "up", "--data-dir", str(path))
        assert out.returncode == 1 and "held by another process" in out.stderr
    finally:
        holder.release()
    assert Migrator(path).status().version == 1


@pytest.mark.parametrize("made", [False, True], ids=["absent", "empty"])
def test_up_where_no_store_is_says_so_and_leaves_the_directory_for_one(
    tmp_path: Path, made: bool
) -> None:
    path = tmp_path / "s"
    if made:
        path.mkdir()
    out = cli("migrate", "up", "--data-dir", str(path))
    assert out.returncode == 1 and f"no store at {path}" in out.stderr, out.stderr
    assert path.is_dir() == made and (not made or not any(path.iterdir()))
    Store.open(path).close()  # a daemon still creates its store there


def test_a_running_daemon_holds_its_store(tmp_path: Path) -> None:
    Store.open(tmp_path / "s").close()
    sock_dir = Path(tempfile.mkdtemp(prefix="pd-mig", dir="/tmp"))  # a socket path holds 107 bytes
    sock = sock_dir / "prefixd.sock"
    notify_path = str(sock_dir / "notify")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # the daemon says READY=1 here
    notify.bind(notify_path)
    notify.settimeout(20)
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "prefixd",
            "serve",
            "--data-dir",
            str(tmp_path / "s"),
            "--socket",
            str(sock),
        ],
        stderr=subprocess.PIPE,
        env={**os.environ, "NOTIFY_SOCKET": notify_path},
    )
    try:
        while b"READY=1" not in notify.recv(65536).split(b"\n"):
            pass  # other states (STATUS=...) come first
        out = cli("migrate", "up", "--data-dir", str(tmp_path / "s"))
        assert out.returncode == 1 and "held by another process" in out.stderr
    finally:
        daemon.send_signal(signal.SIGTERM)
        notify.close()
        assert daemon.wait(20) == 0
        shutil.rmtree(sock_dir, ignore_errors=True)


# --- crashes ---------------------------------------------------------------------------------------


def make_old_store(path: Path, n_blocks: int) -> dict[bytes, int]:
    identity = Identity(
        model="m",
        weights="w",
        tokenizer="t",
        template="c",
        rope="r",
        kv_layout="bf16",
        block_tokens=2,
        tenant="a",
    )
    with Store.open(path) as store:
        tokens = np.arange(2 * n_blocks, dtype=np.uint32)
        for start in range(0, n_blocks, 500):
            count = min(500, n_blocks - start)
            store.put(identity, tokens, [b"p" * 8] * count, first_block=start)
    write_as_version_1(path)
    return {k: V1_ACCESS.unpack(v)[0] for k, v in access_values(path).items()}


def test_kill_9_at_any_point_then_resume(tmp_path: Path) -> None:
    path = tmp_path / "s"
    old = make_old_store(path, 12000)
    kills = 0
    for delay in (0.0, 0.02, 0.05):
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "prefixd",
                "migrate",
                "up",
                "--batch",
                "1",
                "--data-dir",
                str(path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        # real time, on purpose: the migration runs in another process, whose progress is read
        # from the store until it is under way, and the kill lands `delay` seconds into it
        while time.monotonic() < deadline and child.poll() is None:
            status = Migrator(path).status()
            if status.resuming == 2 or status.version >= 2:
                break
            time.sleep(0.005)
        time.sleep(delay)
        if child.poll() is None:
            child.send_signal(signal.SIGKILL)
            kills += 1
        child.wait()
        status = Migrator(path).status()
        assert status.version in (1, 2, 3)  # exactly one version, whatever the moment
    assert kills >= 2, "the kills should land mid-migration"
    assert Migrator(path).status().version == 1 and Migrator(path).status().resuming == 2
    final = cli("migrate", "up", "--data-dir", str(path))
    assert final.returncode == 0, final.stderr
    new = {k: AccessRecord.decode(v) for k, v in access_values(path).items()}
    assert {k: a.last_ns for k, a in new.items()} == old  # nothing lost, nothing duplicated
    assert all(a.hits == 0 for a in new.values())
    status = Migrator(path).status()
    assert (status.version, status.resuming) == (SCHEMA_VERSION, None)
    with Store.open(path, create=False) as store:
        assert store.check() == [] and store.stats().blocks == 12000


def test_a_failed_fsync_at_the_end_of_an_upgrade_is_recorded_and_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upgrade's last fsync fails as the store's own do: SyncFailedError, the store's marker
    written, so the next open rechecks what was written and refuses writes until then."""
    from prefixd.migrate import runner

    class FailingSync:
        def __init__(self, env: lmdb.Environment) -> None:
            self.env = env

        def sync(self, force: bool = False) -> None:
            raise lmdb.DiskError("mdb_env_sync: Input/output error")

        def __getattr__(self, name: str) -> object:
            return getattr(self.env, name)

    path = copy_fixture(tmp_path, "none")
    opened = runner.open_environment

    def failing(*args: object, **kwargs: object) -> object:
        env, tables, meta = opened(*args, **kwargs)  # type: ignore[arg-type]
        return (env, tables, meta) if kwargs.get("readonly") else (FailingSync(env), tables, meta)

    monkeypatch.setattr(runner, "open_environment", failing)
    with pytest.raises(SyncFailedError):
        Migrator(path).upgrade()
    monkeypatch.undo()
    assert (path / SYNC_MARKER).exists()
    with Store.open(path) as store:
        assert store.rechecked is not None


def test_a_backup_is_readable_by_its_owner_alone(tmp_path: Path) -> None:
    """A backup holds every tenant's bytes: its directory is 0700 and its file 0600, whatever the
    directory it was given."""
    path = copy_fixture(tmp_path, "none")
    backup = tmp_path / "backups" / "before"
    backup.mkdir(parents=True, mode=0o755)
    Migrator(path).upgrade(backup=backup)
    assert backup.stat().st_mode & 0o777 == 0o700
    assert (backup / "data.mdb").stat().st_mode & 0o777 == 0o600
