"""Applying migration steps to a store, offline, resumably."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb

from prefixd.clock import SystemClock
from prefixd.errors import MigrationError, NotAStoreError, StoreBusyError
from prefixd.migrate import access_hits, per_identity, state_parts
from prefixd.migrate.steps import Migration
from prefixd.schema.meta import SCHEMA_VERSION, StoreMeta, with_version
from prefixd.store.config import StoreConfig
from prefixd.store.environment import (
    DATA_FILE,
    OwnerLock,
    is_held,
    open_environment,
    private_copy,
)
from prefixd.store.sync_state import SyncState
from prefixd.store.tables import META_KEY, Tables

# A step's batch size: large enough to amortise commits, small enough that a batch is quick.
DEFAULT_BATCH = 10_000
Progress = Callable[[Migration, int], None]  # (step, items looked at in the last batch)


@dataclass(frozen=True)
class MigrationStatus:
    path: Path
    version: int
    target: int
    pending: tuple[Migration, ...]
    resuming: int | None  # the step an interrupted migration left half done, if any

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "version": self.version,
            "code_version": self.target,
            "pending": [{"version": m.version, "description": m.description} for m in self.pending],
            "resuming": self.resuming,
        }


@dataclass
class StepReport:
    version: int
    description: str
    would_change: int
    examined: int
    changed: int = 0
    seconds: float = 0.0


@dataclass
class UpgradeReport:
    path: Path
    from_version: int
    to_version: int
    dry_run: bool
    steps: list[StepReport] = field(default_factory=list)
    backup: str | None = None

    def describe(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "from_version": self.from_version,
            "to_version": self.to_version,
            "dry_run": self.dry_run,
            "backup": self.backup,
            "steps": [vars(step) for step in self.steps],
        }


def registry() -> tuple[Migration, ...]:
    """Every migration step, in version order (append only: a shipped step never changes)."""
    steps = (
        access_hits.STEP,
        per_identity.IDENTITY_BYTES,
        state_parts.STEP,
        per_identity.IDENTITY_BLOCKS,
    )
    assert [s.version for s in steps] == list(range(2, 2 + len(steps))), "steps out of order"
    return steps


class Migrator:
    """Migrations of the store at `path`. Never run beside a daemon holding the store."""

    def __init__(
        self, path: Path, *, batch: int = DEFAULT_BATCH, settings: StoreConfig | None = None
    ) -> None:
        """`settings`: what `serve` opens the store with (None: the defaults)."""
        if batch < 1:
            raise MigrationError(f"batch must be at least 1, got {batch}")
        self.path = Path(path)
        self.batch = batch
        self.settings = settings or StoreConfig(path=self.path)
        self.steps = registry()

    def status(self) -> MigrationStatus:
        env, _tables, meta = self._open(readonly=True)
        env.close()
        return MigrationStatus(
            self.path,
            meta.schema_version,
            SCHEMA_VERSION,
            self._pending(meta, None),
            _resuming(meta),
        )

    def upgrade(
        self,
        *,
        to: int | None = None,
        dry_run: bool = False,
        backup: Path | None = None,
        progress: Progress | None = None,
    ) -> UpgradeReport:
        """Apply the pending steps up to version `to` (default: this code's version)."""
        if dry_run:
            return self._dry_run(to)
        if not (self.path / DATA_FILE).is_file():  # the lock file would make it "not empty"
            raise NotAStoreError(f"no store at {self.path}")
        owner = OwnerLock(self.path)  # refuses while a daemon holds the store
        try:
            env, tables, meta = self._open(readonly=False)
            try:
                return self._upgrade(env, tables, meta, to, backup, progress)
            finally:
                _sync_and_close(self.path, env)
        finally:
            owner.release()

    # --- internals ------------------------------------------------------------------------------

    def _open(self, *, readonly: bool) -> tuple[lmdb.Environment, Tables, StoreMeta]:
        config = dataclasses.replace(self.settings, path=self.path, create=False, verify_threads=0)
        return open_environment(config, any_version=True, readonly=readonly)

    def _pending(self, meta: StoreMeta, to: int | None) -> tuple[Migration, ...]:
        target = SCHEMA_VERSION if to is None else to
        if not meta.schema_version <= target <= SCHEMA_VERSION:
            raise MigrationError(
                f"cannot migrate from version {meta.schema_version} to {target}: "
                f"migrations go forward, up to version {SCHEMA_VERSION}"
            )
        return tuple(s for s in self.steps if meta.schema_version < s.version <= target)

    def _dry_run(self, to: int | None) -> UpgradeReport:
        if is_held(self.path):
            raise StoreBusyError(f"{self.path} is held by a running daemon: stop it first")
        env, tables, meta = self._open(readonly=True)
        try:
            steps = self._pending(meta, to)
            report = UpgradeReport(self.path, meta.schema_version, _target(meta, steps), True)
            with env.begin(buffers=True) as txn:
                for step in steps:
                    would, examined = step.pending(txn, tables)
                    report.steps.append(StepReport(step.version, step.description, would, examined))
            return report
        finally:
            env.close()

    def _upgrade(
        self,
        env: lmdb.Environment,
        tables: Tables,
        meta: StoreMeta,
        to: int | None,
        backup: Path | None,
        progress: Progress | None,
    ) -> UpgradeReport:
        steps = self._pending(meta, to)
        report = UpgradeReport(self.path, meta.schema_version, _target(meta, steps), False)
        if backup is not None and steps:
            report.backup = str(_backup(env, backup))
        for step in steps:
            with env.begin(buffers=True) as txn:
                would, examined = step.pending(txn, tables)
            entry = StepReport(step.version, step.description, would, examined)
            report.steps.append(entry)
            started = time.perf_counter()
            cursor = _cursor_for(meta, step)
            left = examined
            while True:
                with env.begin(write=True) as txn:
                    cursor, changed = step.apply(txn, tables, cursor, self.batch)
                    if cursor is None:  # the step's last batch carries the version stamp
                        meta = with_version(meta, step.version, migrating=None)
                    else:
                        resume = {"to": step.version, "cursor": cursor}
                        meta = with_version(meta, meta.schema_version, migrating=resume)
                    txn.put(META_KEY, meta.encode(), db=tables.meta)
                entry.changed += changed
                if progress is not None:
                    progress(step, min(self.batch, left))
                left = max(0, left - self.batch)
                if cursor is None:
                    break
            entry.seconds = round(time.perf_counter() - started, 6)
        return report


def _target(meta: StoreMeta, steps: tuple[Migration, ...]) -> int:
    return steps[-1].version if steps else meta.schema_version


def _resuming(meta: StoreMeta) -> int | None:
    migrating = meta.settings.get("migrating")
    return migrating.get("to") if isinstance(migrating, dict) else None


def _cursor_for(meta: StoreMeta, step: Migration) -> bytes | None:
    migrating = meta.settings.get("migrating")
    if isinstance(migrating, dict) and migrating.get("to") == step.version:
        cursor = migrating.get("cursor")
        return bytes(cursor) if cursor is not None else None
    return None


def _backup(env: lmdb.Environment, directory: Path) -> Path:
    """A compacted copy of the store, taken before anything changes."""
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise MigrationError(f"backup directory {directory} is not empty")
    try:
        private_copy(env, directory)
    except lmdb.Error as exc:
        shutil.rmtree(directory, ignore_errors=True)
        raise MigrationError(f"backup to {directory} failed: {exc}") from None
    return directory


def _sync_and_close(path: Path, env: lmdb.Environment) -> None:
    """The upgrade's last fsync, failing as the store's own do: recorded in the store's marker
    (the next open rechecks and refuses writes), then SyncFailedError; closed either way."""
    syncs = SyncState(path, SystemClock())
    try:
        if not syncs.sync(env):
            syncs.check_writable()
    finally:
        env.close()
