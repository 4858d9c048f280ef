"""Opening a store's LMDB environment, telling "not a store", "wrong version" and "corrupt" apart
before anything is written."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb

from prefixd.errors import (
    CorruptMetaError,
    CorruptStoreError,
    NotAStoreError,
    SchemaVersionError,
    StoreBusyError,
    StoreOpenError,
)
from prefixd.schema.meta import FORMAT_SETTINGS, SCHEMA_VERSION, StoreMeta, new_meta
from prefixd.store.config import Durability, StoreConfig
from prefixd.store.lmdb_errors import lmdb_errors
from prefixd.store.tables import META_KEY, TABLE_NAMES, Tables

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
OWNER_FILE = "owner.lock"
_DUPSORT = {"children"}
# Tables added by a schema version: an older store gets them, empty, when a migration opens it.
_TABLE_SINCE = {"parts": 4}


def open_environment(
    config: StoreConfig,
    *,
    any_version: bool = False,
    readonly: bool = False,
    now_ns: Callable[[], int] = time.time_ns,
) -> tuple[lmdb.Environment, Tables, StoreMeta]:
    """Open (or create) the store at `config.path`. Never writes into a directory that is not
    already a store unless it is absent or empty. `any_version`: accept an older schema (migrations,
    which take the owner lock themselves).

    A store another process holds is refused unless `readonly`: LMDB would let a second writer in
    beside the daemon, whose counts and caches would stop being the store's."""
    path = config.path
    if path.exists() and not path.is_dir():
        raise NotAStoreError(f"{path} is not a directory")
    refuse_links(path)
    if not readonly and not any_version and is_held(path):
        raise StoreBusyError(held_message(path))
    data_file = path / DATA_FILE
    lock_file = path / LOCK_FILE
    creating = not data_file.exists()
    if not creating and data_file.stat().st_size == 0:  # LMDB would write fresh meta pages
        raise NotAStoreError(f"{data_file} is empty: not a store (nothing was written to it)")
    had_lock = lock_file.exists()
    created = [file for file, had in ((data_file, not creating), (lock_file, had_lock)) if not had]
    if creating:
        if not config.create or readonly:
            raise NotAStoreError(f"no store at {path}")
        if path.exists() and any(path.iterdir()):
            raise NotAStoreError(f"{path} is not empty and holds no prefixd store")
        path.mkdir(mode=0o750, parents=True, exist_ok=True)
    try:
        env = lmdb.open(
            str(path),
            map_size=config.map_size,
            max_dbs=len(TABLE_NAMES),
            max_readers=config.max_readers,
            subdir=True,
            create=creating,
            readahead=config.readahead,
            sync=config.durability is Durability.FULL,
            metasync=config.durability is Durability.FULL,
            writemap=False,
            readonly=readonly,
            mode=0o640,
        )
    except lmdb.Error as exc:
        refusal = _not_damage(exc, config, readonly)
        if refusal is not None:
            raise StoreOpenError(refusal) from None
        mismatch = isinstance(exc, lmdb.VersionMismatchError)
        foreign = mismatch or isinstance(exc, (lmdb.InvalidError, lmdb.CorruptedError))
        if foreign and not had_lock:  # leave a directory that is not a store as it was
            lock_file.unlink(missing_ok=True)
        if not mismatch and _has_lmdb_magic(data_file):
            raise CorruptStoreError(
                f"{data_file} is an LMDB file whose meta pages are damaged"
                f"{'' if foreign else f' ({exc})'}; restore it from a backup, or delete the "
                "directory and let the cache refill"
            ) from None
        if not foreign:
            raise StoreOpenError(f"cannot open {path}: {exc}") from None
        kind = "of another LMDB version" if mismatch else "not an LMDB file"
        raise NotAStoreError(f"{data_file} is {kind}") from None
    finally:  # whether or not it opened: what LMDB left is the directory owner's
        for file in created:
            give_to_directory_owner(file)
    try:
        if creating:
            tables, meta = _create(env, now_ns())
        else:
            _check_whole(env, data_file)
            tables, meta = _open_existing(env, path, any_version=any_version, readonly=readonly)
    except lmdb.Error as exc:  # a damaged page met while reading the tables or the meta record
        env.close()
        refusal = _not_damage(exc, config, readonly)
        if refusal is not None:
            raise StoreOpenError(refusal) from None
        raise CorruptStoreError(f"{data_file} has damaged pages: {exc}") from None
    except BaseException:
        env.close()
        raise
    return env, tables, meta


# What LMDB runs out of, not what a file holds: a setting or the machine, never damage.
_RESOURCES = (
    lmdb.MapFullError,
    lmdb.ReadersFullError,
    lmdb.DbsFullError,
    lmdb.TlsFullError,
    lmdb.MapResizedError,
)
_NOT_ALLOWED = (errno.EACCES, errno.EPERM, errno.EROFS)


def _not_damage(exc: lmdb.Error, config: StoreConfig, readonly: bool) -> str | None:
    """Why the store could not be opened when the system refused (an errno: permission, memory,
    space, a lock) or LMDB ran out of a resource; None when the error is about the files'
    content. A refusal is no damage: the store must never be called damaged, nor its deletion
    advised, for it."""
    path = config.path
    code = getattr(exc, "code", 0)
    if isinstance(exc, _RESOURCES):
        return f"cannot open the store at {path}: {exc}"
    if not isinstance(code, int) or code <= 0:  # LMDB's own codes are negative
        return None
    reason = os.strerror(code)
    if code == errno.ENOMEM:
        return (
            f"cannot map the store at {path} ({reason}): its map of {config.map_size} bytes (or "
            "the size its data file records) is more than this process may map; give a smaller "
            "map_size (--map-size, PREFIXD_MAP_SIZE)"
        )
    if code in _NOT_ALLOWED:
        wanted = os.R_OK if readonly else os.R_OK | os.W_OK
        files = [path / LOCK_FILE, path / DATA_FILE]
        refused = [str(f) for f in files if f.exists() and not os.access(f, wanted)] or [str(path)]
        return (
            f"cannot open {' or '.join(refused)} ({reason}) as uid {os.geteuid()}: run as the "
            "user that owns the store, or give its files to that user (chown)"
        )
    if code == errno.ENOSPC:
        return f"cannot open the store at {path}: no space left on the device for {LOCK_FILE}"
    return f"cannot open the store at {path} ({reason})"


def _check_whole(env: lmdb.Environment, data_file: Path) -> None:
    """Refuse a data file shorter than its last page (a partial copy): reading a page past the end
    of the file kills the process (SIGBUS)."""
    needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    size = data_file.stat().st_size
    if size < needed:
        raise CorruptStoreError(
            f"{data_file} is {size} bytes, cut short: its pages reach {needed} bytes; restore it "
            "from a backup, or delete the directory and let the cache refill"
        )


_LMDB_MAGIC = 0xBEEFC0DE
_META_MAGIC_AT = 16  # after the page header, in both meta pages (pages 0 and 1)


def _has_lmdb_magic(data_file: Path) -> bool:
    """Whether either meta page keeps LMDB's magic, so a failure to open is damage, not another kind
    of file."""
    try:
        with data_file.open("rb") as file:
            head = file.read(2 * 65536)
    except OSError:
        return False
    for page_size in (4096, 8192, 16384, 65536):
        for page in (0, 1):
            at = page * page_size + _META_MAGIC_AT
            if int.from_bytes(head[at : at + 4], "little") == _LMDB_MAGIC:
                return True
    return False


def _create(env: lmdb.Environment, created_ns: int) -> tuple[Tables, StoreMeta]:
    meta = new_meta(created_ns)
    with env.begin(write=True) as txn:
        handles = {
            name: env.open_db(name.encode(), txn=txn, create=True, dupsort=name in _DUPSORT)
            for name in TABLE_NAMES
        }
        txn.put(META_KEY, meta.encode(), db=handles["meta"])
    env.sync(True)
    return Tables(**handles), meta


def _open_existing(
    env: lmdb.Environment, path: Path, *, any_version: bool, readonly: bool
) -> tuple[Tables, StoreMeta]:
    if readonly:  # handles opened inside a read transaction would not outlive it
        meta_db = _open_meta_table(env, path, None)
        with env.begin() as txn:
            meta = _read_meta(txn, meta_db, path, any_version)
        return _open_tables(env, path, None, meta_db, meta.schema_version), meta
    with env.begin(write=True) as txn:
        meta_db = _open_meta_table(env, path, txn)
        meta = _read_meta(txn, meta_db, path, any_version)
        return _open_tables(env, path, txn, meta_db, meta.schema_version), meta


def _open_meta_table(
    env: lmdb.Environment, path: Path, txn: lmdb.Transaction | None
) -> lmdb._Database:
    try:
        return env.open_db(b"meta", txn=txn, create=False)
    except (lmdb.NotFoundError, lmdb.IncompatibleError):
        # IncompatibleError: the main database holds a plain b"meta" key, not a named table
        raise NotAStoreError(f"{path} is an LMDB environment but not a prefixd store") from None


def _read_meta(
    txn: lmdb.Transaction, meta_db: lmdb._Database, path: Path, any_version: bool
) -> StoreMeta:
    raw = txn.get(META_KEY, db=meta_db)
    if raw is None:
        raise NotAStoreError(f"{path} has no prefixd meta record")
    try:
        meta = StoreMeta.decode(bytes(raw), supported=None if any_version else SCHEMA_VERSION)
    except SchemaVersionError as exc:
        raise SchemaVersionError(exc.found, exc.supported, path) from None
    except CorruptMetaError as exc:
        raise CorruptMetaError(f"{path}: {exc}") from None
    for key, expected in FORMAT_SETTINGS.items():
        if meta.settings.get(key) != expected:
            raise CorruptMetaError(
                f"{path}: meta setting {key}={meta.settings.get(key)!r}, this prefixd writes "
                f"{expected!r}"
            )
    return meta


def _open_tables(
    env: lmdb.Environment,
    path: Path,
    txn: lmdb.Transaction | None,
    meta_db: lmdb._Database,
    version: int,
) -> Tables:
    handles: dict[str, lmdb._Database] = {"meta": meta_db}
    for name in TABLE_NAMES[1:]:
        # a table an older store lacks is created when it is opened to be migrated (the step to
        # that version needs it); a read-only view, without a transaction, goes without it
        added = version < _TABLE_SINCE.get(name, 0)
        if added and txn is None:
            continue
        try:
            handles[name] = env.open_db(
                name.encode(), txn=txn, create=added, dupsort=name in _DUPSORT
            )
        except lmdb.NotFoundError:
            raise CorruptStoreError(f"{path} lacks the {name!r} table") from None
        except lmdb.IncompatibleError:
            raise CorruptStoreError(f"{path} has a {name!r} table of the wrong kind") from None
    parts = handles.pop("parts", None)  # the one table a store may lack (_TABLE_SINCE)
    return Tables(**handles, parts=parts)


def private_copy(env: lmdb.Environment, target: Path) -> None:
    """A compacted copy of the store in `target`, its owner's alone (directory 0700, file 0600):
    it holds every tenant's bytes."""
    target.mkdir(mode=0o700, parents=True, exist_ok=True)
    target.chmod(0o700)
    env.copy(str(target), compact=True)
    (target / DATA_FILE).chmod(0o600)


def copy_compacted(
    env: lmdb.Environment, source: Path, target: Path, map_size: int
) -> dict[str, Any]:
    if target.exists() and not target.is_dir():
        raise StoreOpenError(f"{target} is not a directory")
    if target.exists() and any(target.iterdir()):
        raise StoreOpenError(f"{target} is not empty")
    with lmdb_errors(target, map_size, "the compacted copy"):  # the copy's disk, not the store's
        private_copy(env, target)
    return {
        "from": str(source),
        "to": str(target),
        "bytes_before": (source / DATA_FILE).stat().st_size,
        "bytes_after": (target / DATA_FILE).stat().st_size,
    }


class OwnerLock:
    """A flock on DIR/owner.lock, held by a daemon while it serves the store and by offline tools
    that must not run beside one; released when the process dies."""

    def __init__(self, path: Path) -> None:
        self.path = path / OWNER_FILE
        refuse_links(path)
        had = self.path.exists()
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW  # a link made since: ELOOP
        fd = os.open(self.path, flags, 0o640)
        if not had:
            give_to_directory_owner(self.path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusyError(held_message(path)) from None
        os.ftruncate(fd, 0)  # the last holder's socket is no longer this store's
        self._fd = fd

    def record(self, socket: Path) -> None:
        """Note the socket the holder serves on, so a command given only the directory finds its
        daemon."""
        data = json.dumps({"pid": os.getpid(), "socket": str(socket)}).encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, data, 0)

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing drops the flock
            self._fd = -1


def give_to_directory_owner(file: Path) -> None:
    """Hand a file root just created in a store's directory to the directory's owner and group:
    root's offline work (migrate, verify, compact) must leave no lock or data file the daemon,
    running as that owner, cannot open. The mode is left as created."""
    if os.geteuid() != 0:
        return
    try:
        directory = file.parent.stat()
        made = file.lstat()
        if (made.st_uid, made.st_gid) != (directory.st_uid, directory.st_gid):
            os.chown(file, directory.st_uid, directory.st_gid, follow_symlinks=False)
    except FileNotFoundError:  # removed again (a foreign directory left as it was)
        pass


def held_socket(path: Path) -> Path | None:
    """The socket of the daemon holding the store at `path`; None when nobody holds it or the holder
    serves none."""
    try:
        return _recorded_socket(path) if is_held(path) else None
    except OSError:
        return None


def held_message(path: Path) -> str:
    """Why the store, held by another process, cannot be opened: with the daemon's socket to go
    through instead, when it recorded one, and how to stop it for good under systemd."""
    socket = _recorded_socket(path)
    if socket is None:
        return (
            f"{path} is held by another process (a migration, or a daemon starting): wait for "
            f"it, or stop it first{_stop_units(path)}"
        )
    return (
        f"{path} is held by another process, the prefixd daemon serving it on {socket}: go "
        f"through it (prefixd verify or purge --socket {socket}, or a client), or stop it "
        f"first{_stop_units(path)}"
    )


def _stop_units(path: Path) -> str:
    """How to stop the daemon of the shipped units serving `path` (/var/lib/prefixd or
    /var/lib/prefixd-NAME): its socket unit too, or the next connection starts it again."""
    name = path.name
    if name == "prefixd":
        unit = "prefixd"
    elif name.startswith("prefixd-"):
        unit = f"prefixd@{name.removeprefix('prefixd-')}"
    else:
        return ""
    return (
        f" (under systemd both units: systemctl stop {unit}.socket {unit}.service; the socket "
        "alone starts the daemon again)"
    )


def _recorded_socket(path: Path) -> Path | None:
    try:
        with open(path / OWNER_FILE, "rb") as file:
            text = file.read(4096)
        socket = json.loads(text).get("socket") if text else None
    except (OSError, ValueError, AttributeError):
        return None
    return Path(socket) if isinstance(socket, str) and socket else None


def refuse_links(path: Path) -> None:
    """Refuse a store whose files are symbolic links: LMDB and the owner lock create, write and
    truncate them, so a link placed by whoever may write the directory (the service user, for
    root's offline commands) would have this process write any file it may, /etc's included."""
    for name in (DATA_FILE, LOCK_FILE, OWNER_FILE):
        if (path / name).is_symlink():
            raise StoreOpenError(
                f"{path / name} is a symbolic link: a store's files are refused as links, since "
                "opening it writes where it points; replace it with the file itself"
            )


def is_held(path: Path) -> bool:
    try:
        fd = os.open(path / OWNER_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
