"""The one translation of LMDB's exceptions into prefixd's, for every path out of the store.

A caller can act on a prefixd error (StoreFullError: evict or grow the map; DiskFullError: free
space; CorruptStoreError: `prefixd verify`, or delete the store), not on an lmdb one. Code inside
the store still catches lmdb.MapFullError where it can do something about it (a put settles and
evicts, then tries again) and lmdb.Error where a failure is only a hint lost (access times, a
quarantine retried on the next read); whatever leaves the store goes through `translate`: each
public method of `Store` runs under it, and `lmdb_errors` applies it to a block of code that
writes somewhere else (a compacted copy).

Opening a store tells "not a store", "another version" and "damaged" apart before any of this
(prefixd.store.environment): an open that fails has no store to translate for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import lmdb

from prefixd.errors import (
    CorruptStoreError,
    DiskFullError,
    InternalError,
    PrefixdError,
    StoreFullError,
    StoreWriteError,
)

# What LMDB raises on a damaged page: the B-tree points somewhere it should not.
DAMAGE = (lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadValsizeError)
# Below this much free space, a failed write is taken for a full file system.
DISK_FULL_BYTES = 16 << 20


def translate(
    exc: lmdb.Error, path: Path, map_size: int, doing: str, *, writing: bool = True
) -> PrefixdError:
    """The prefixd error that `exc`, raised while `doing` ("the put") on the store at `path`,
    means for the caller. LMDB reports a file system without room as an I/O error at commit, so
    the free space under `path` tells a full disk from another I/O error. A read (`writing`
    False) fails otherwise only for a reason the store did not foresee: InternalError."""
    if isinstance(exc, DAMAGE):
        return CorruptStoreError(f"{path} has damaged pages: {exc}")
    if isinstance(exc, lmdb.MapFullError):
        return StoreFullError(f"store map of {map_size} bytes is full; {doing} was rolled back")
    if not writing:
        return InternalError(f"{doing} of {path} failed: {exc}")
    free = free_bytes(path)
    if 0 <= free < DISK_FULL_BYTES:
        return DiskFullError(
            f"the file system under {path} is full ({free} bytes free); the write was rolled "
            "back, reads go on, and writes resume once space is freed"
        )
    return StoreWriteError(f"the write to {path} failed and was rolled back: {exc}")


@contextlib.contextmanager
def lmdb_errors(path: Path, map_size: int, doing: str, *, writing: bool = True) -> Iterator[None]:
    """Raise what `translate` makes of an lmdb.Error from the block (never the lmdb error)."""
    try:
        yield
    except lmdb.Error as exc:
        raise translate(exc, path, map_size, doing, writing=writing) from None


def free_bytes(path: Path) -> int:
    """Bytes free to an unprivileged writer under `path` (-1 if that cannot be told)."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return -1
    return vfs.f_bavail * vfs.f_frsize


__all__ = ["DAMAGE", "DISK_FULL_BYTES", "free_bytes", "lmdb_errors", "translate"]
