"""Calls into Mooncake's client: its error codes and the exceptions they become, the checks of keys
and buffers, the threads its calls run on, and the clients that could not be closed.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import numpy as np
import xxhash

from prefixd.errors import (
    TierBusyError,
    TierError,
    TierFullError,
    TierTransferError,
    TierUnavailableError,
    TierValueError,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

MAX_KEY_BYTES = 4096
"""Longest key this adapter accepts, in UTF-8 bytes (Mooncake itself accepted 1 MiB keys)."""

# Mooncake's ErrorCode values (mooncake-store/include/types.h) that this module names.
_CODE_NAMES: dict[int, str] = {
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}
NOT_FOUND = -704
_HAS_LEASE = -706
INVALID_PARAMS = -600
# A put's transfer into the segment the master placed its value in failed, or the replica went: that
# segment's client is dead. The master keeps a killed client's segment in its pool until the
# client's lease runs out (about 10 s) and goes on placing values there meanwhile.
_TRANSFER_FAIL = -800
_PLACEMENT_LOST = frozenset({_TRANSFER_FAIL, NOT_FOUND})
# Codes that mean "the cluster cannot be reached right now", not "this request is wrong".
_UNAVAILABLE_CODES = frozenset({-103, -900, -1010, -1011})

# Clients kept alive (their destructor would run Mooncake's close, GIL held), each with its
# tier's count of calls still running (closed once that is 0)
_ABANDONED: list[tuple[Any, Callable[[], int]]] = []
_ABANDONED_LOCK = threading.Lock()


def code_name(code: int) -> str:
    return f"{_CODE_NAMES.get(code, 'UNKNOWN')} ({code})"


def failure(what: str, code: int) -> TierError:
    message = f"{what} failed: {code_name(code)}"
    if code in _UNAVAILABLE_CODES:
        return TierUnavailableError(message, code)
    if code == _HAS_LEASE:
        return TierBusyError(message, code)
    if code == _TRANSFER_FAIL:
        return TierTransferError(message, code)
    if code == -200:
        return TierFullError(
            f"{message} (pool full, or no segment mounted yet after a master restart)", code
        )
    return TierError(message, code)


def put_placed(client: Any, put: Callable[..., Any], *args: Any) -> int:
    """`put(*args)`'s return code. A value placed in a dead client's segment is put again, into
    `client`'s own segment, which lives as long as `client` does (the first placement is left to
    the master, so that values spread over the pool)."""
    rc = int(put(*args))
    if rc in _PLACEMENT_LOST:
        from mooncake.store import ReplicateConfig  # imported already, with the client's class

        own = ReplicateConfig()
        own.preferred_segment = client.get_hostname()
        rc = int(put(*args, own))
    return rc


def check_key(key: str) -> str:
    if not isinstance(key, str):
        raise TierValueError(f"key must be a str, not {type(key).__name__}")
    if not key:
        raise TierValueError("key is empty")
    if "\x00" in key:
        raise TierValueError("key contains NUL")
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError as e:
        raise TierValueError(f"key is not valid Unicode text: {e}") from None
    if n > MAX_KEY_BYTES:
        raise TierValueError(f"key is {n} UTF-8 bytes, more than {MAX_KEY_BYTES}")
    return key


def bytes_view(value: Any, *, writable: bool) -> tuple[np.ndarray, int, int]:
    """(an array keeping the memory alive, its address, its length)"""
    try:
        view = memoryview(value)
    except TypeError:
        raise TierValueError(f"{type(value).__name__} does not expose a buffer") from None
    if writable and view.readonly:
        raise TierValueError("the buffer is read-only")
    if not view.c_contiguous:
        raise TierValueError("the buffer is not C-contiguous")
    if view.nbytes == 0:
        return np.zeros(0, dtype=np.uint8), 0, 0
    try:
        flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as e:
        raise TierValueError(f"the buffer cannot be read as bytes: {e}") from None
    array = np.frombuffer(flat, dtype=np.uint8)  # holds the buffer: it cannot be freed under us
    return array, int(array.ctypes.data), array.nbytes


def escape_regex(text: str) -> str:
    """`text` as a literal for Mooncake's (ECMAScript, unanchored) patterns."""
    return "".join(
        "\\" + c if c.isascii() and c.isprintable() and not c.isalnum() and c != "_" else c
        for c in text
    )


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def tag(key: str) -> str:
    """A key as logs and errors name it: a short hash (keys hold identity digests and block hashes,
    which logs must not carry)."""
    return f"key #{xxhash.xxh32_hexdigest(key.encode('utf-8', 'replace'))}"


def import_store_class() -> Any:
    # Mooncake logs a line per connection and call at INFO; keep its warnings and errors
    # (its keys are names derived from prefixd's keys: prefixd.cluster.blocks).
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # the package, or libibverbs.so.1 (Debian's libibverbs1), missing
        raise TierUnavailableError(
            f"Mooncake's client cannot be imported ({e}); install prefixd[cluster] "
            "(mooncake-transfer-engine-non-cuda) and Debian's libibverbs1"
        ) from e
    return MooncakeDistributedStore


def abandon(client: Any, in_flight: Callable[[], int]) -> None:
    """Keep `client` alive for good: its destructor would run Mooncake's close (GIL held)."""
    with _ABANDONED_LOCK:
        _ABANDONED.append((client, in_flight))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(client))  # no destructor at interpreter exit


def close_abandoned() -> int:
    """Close the abandoned clients whose calls have all returned; the number closed. Call it once
    the master answers again: Mooncake closes every client left at exit, seconds each when the
    master is gone."""
    with _ABANDONED_LOCK:
        ready = [entry for entry in _ABANDONED if entry[1]() == 0]
        for entry in ready:
            _ABANDONED.remove(entry)
    for client, _ in ready:
        try:
            client.close()
        except Exception as e:  # noqa: BLE001 - best effort
            log.warning("closing an abandoned Mooncake client failed: %s", e)
    return len(ready)


class Workers:
    """Daemon threads running Mooncake calls: unlike ThreadPoolExecutor's they never keep the
    interpreter from exiting when a call hangs for good."""

    def __init__(self, n: int, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None]
        self._queue = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True) for i in range(n)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._queue.put((future, fn))
        return future

    def shutdown(self) -> None:
        for _ in self._threads:
            self._queue.put(None)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(e)
            else:
                future.set_result(result)
