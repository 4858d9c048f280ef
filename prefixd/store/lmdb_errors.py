"""The one translation of LMDB's exceptions into prefixd's, for every path out of the store: a
caller can act on StoreFullError, DiskFullError or CorruptStoreError, not on an lmdb error. Inside,
the store still catches lmdb.MapFullError where it can act (a put makes room) and lmdb.Error where
only a hint is lost (access times, a quarantine retried on the next read)."""

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
    """The prefixd error `exc`, raised while `doing` on the store at `path`, means. LMDB reports a
    full file system as an I/O error at commit, so the free space tells them apart; a read fails
    otherwise only for an unforeseen reason (InternalError)."""
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
    try:
        yield
    except lmdb.Error as exc:
        raise translate(exc, path, map_size, doing, writing=writing) from None


def free_bytes(path: Path) -> int:
    """Bytes free to an unprivileged writer under `path` (-1 if unknown)."""
    try:
        vfs = os.statvfs(path)
    except OSError:
        return -1
    return vfs.f_bavail * vfs.f_frsize
