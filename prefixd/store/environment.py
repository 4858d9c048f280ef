"""Opening the LMDB environment of a store and telling "not a store", "wrong version" and "corrupt"
apart before anything is written.

Tables (LMDB named databases):
  meta        b"meta" -> StoreMeta
  blocks      block hash -> BlockRecord
  chunks      block hash + u32 BE index -> stored payload chunk
  children    parent hash (or identity digest for first blocks) -> child hash (dupsort)
  access      block hash -> last access, u64 ns
  quarantine  block hash -> msgpack {at_ns, reason} of blocks dropped for failing verification
  counters    name -> u64 running totals kept in the same transactions as the data
  identities  identity digest -> Identity.encode()
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import lmdb

from prefixd.errors import CorruptMetaError, CorruptStoreError, NotAStoreError, StoreOpenError
from prefixd.schema.meta import FORMAT_SETTINGS, StoreMeta, new_meta
from prefixd.store.config import Durability, StoreConfig

META_KEY = b"meta"
DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
TABLE_NAMES = (
    "meta",
    "blocks",
    "chunks",
    "children",
    "access",
    "quarantine",
    "counters",
    "identities",
)
_DUPSORT = {"children"}


@dataclass(frozen=True)
class Tables:
    """Handles of the store's named databases."""

    meta: lmdb._Database
    blocks: lmdb._Database
    chunks: lmdb._Database
    children: lmdb._Database
    access: lmdb._Database
    quarantine: lmdb._Database
    counters: lmdb._Database
    identities: lmdb._Database


def open_environment(config: StoreConfig) -> tuple[lmdb.Environment, Tables, StoreMeta]:
    """Open (or, when allowed, create) the store at `config.path`.

    Never writes into a directory that is not already a store, unless it is absent or empty.
    """
    path = config.path
    if path.exists() and not path.is_dir():
        raise NotAStoreError(f"{path} is not a directory")
    data_file = path / DATA_FILE
    lock_file = path / LOCK_FILE
    creating = not data_file.exists()
    had_lock = lock_file.exists()
    if creating:
        if not config.create:
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
            mode=0o640,
        )
    except (lmdb.InvalidError, lmdb.VersionMismatchError) as exc:
        if not had_lock:  # leave a directory that is not a store as it was
            lock_file.unlink(missing_ok=True)
        kind = (
            "not an LMDB file" if isinstance(exc, lmdb.InvalidError) else "of another LMDB version"
        )
        raise NotAStoreError(f"{data_file} is {kind}") from None
    except lmdb.Error as exc:
        raise StoreOpenError(f"cannot open {path}: {exc}") from None
    try:
        if creating:
            tables, meta = _create(env)
        else:
            tables, meta = _open_existing(env, path)
    except BaseException:
        env.close()
        raise
    return env, tables, meta


def _create(env: lmdb.Environment) -> tuple[Tables, StoreMeta]:
    meta = new_meta(time.time_ns())
    with env.begin(write=True) as txn:
        handles = {
            name: env.open_db(name.encode(), txn=txn, create=True, dupsort=name in _DUPSORT)
            for name in TABLE_NAMES
        }
        txn.put(META_KEY, meta.encode(), db=handles["meta"])
    env.sync(True)
    return Tables(**handles), meta


def _open_existing(env: lmdb.Environment, path: Path) -> tuple[Tables, StoreMeta]:
    with env.begin(write=True) as txn:
        try:
            meta_db = env.open_db(b"meta", txn=txn, create=False)
        except (lmdb.NotFoundError, lmdb.IncompatibleError):
            # IncompatibleError: the main database holds a plain b"meta" key, not a named table
            raise NotAStoreError(f"{path} is an LMDB environment but not a prefixd store") from None
        raw = txn.get(META_KEY, db=meta_db)
        if raw is None:
            raise NotAStoreError(f"{path} has no prefixd meta record")
        meta = StoreMeta.decode(bytes(raw))
        for key, expected in FORMAT_SETTINGS.items():
            if meta.settings.get(key) != expected:
                raise CorruptMetaError(
                    f"meta setting {key}={meta.settings.get(key)!r}, this prefixd writes {expected!r}"
                )
        handles = {"meta": meta_db}
        for name in TABLE_NAMES[1:]:
            try:
                handles[name] = env.open_db(
                    name.encode(), txn=txn, create=False, dupsort=name in _DUPSORT
                )
            except lmdb.NotFoundError:
                raise CorruptStoreError(f"{path} lacks the {name!r} table") from None
            except lmdb.IncompatibleError:
                raise CorruptStoreError(f"{path} has a {name!r} table of the wrong kind") from None
    return Tables(**handles), meta
