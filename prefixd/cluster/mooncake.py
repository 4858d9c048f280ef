"""A shared tier on Mooncake Store behind the local store, hidden behind a small typed adapter.

Mooncake (github.com/kvcache-ai/Mooncake) pools memory that clients lend, with a master holding only
metadata: a block one node published can be fetched by every other node. `SharedTier` never exposes
Mooncake's API, its return codes or its blocking behaviour; docs/mooncake.md lists the measured
facts it relies on (codes, leases, what hangs and what holds the GIL).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Self, TypeVar

import numpy as np

from prefixd.cluster.mooncake_calls import (
    INVALID_PARAMS,
    NOT_FOUND,
    Workers,
    abandon,
    bytes_view,
    check_key,
    code_name,
    escape_regex,
    failure,
    import_store_class,
    is_loopback,
    put_placed,
    tag,
)
from prefixd.cluster.mooncake_settings import MooncakeSettings
from prefixd.errors import TierError, TierUnavailableError, TierValueError

log = logging.getLogger(__name__)

T = TypeVar("T")


class SharedTier:
    """One Mooncake client for a daemon process, thread-safe. Connects lazily; every call finishes
    within `settings.timeout_s` or raises TierUnavailableError; every failure is a TierError. `put`
    keeps an existing key's value unless `overwrite=True`."""

    def __init__(self, settings: MooncakeSettings) -> None:
        self.settings = settings
        self._client: Any = None
        self._workers: Workers | None = None
        self._slots = threading.BoundedSemaphore(settings.workers)
        self._in_flight = 0
        self._in_flight_lock = threading.Lock()
        self._connect_lock = threading.RLock()  # a late setup's callback may run inside connect
        self._late_setup: Future[int] | None = None  # a setup that outlived its timeout, running
        self._closed = False
        self._down_until = 0.0
        self._down_reason = ""
        self._registered: dict[int, tuple[int, np.ndarray]] = {}  # address -> (length, keepalive)
        self._registered_lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        """Mooncake calls still running, timed-out ones included: a buffer given to a call that
        raised TierUnavailableError may still be touched until this drops."""
        return self._in_flight

    def connect(self) -> None:
        """Connect now (idempotent); TierUnavailableError when the master or the metadata server
        does not answer, or setup fails or times out."""
        with self._connect_lock:
            if self._closed:
                raise TierError("the shared tier is closed")
            if self._client is not None:
                return
            self._check_cooldown()
            if self._late_setup is not None:  # it may yet connect: a second would mount twice
                raise TierUnavailableError("Mooncake setup still running (the master is slow)")
            try:
                self._connect_locked()
            except TierUnavailableError as e:
                self._trip(str(e))
                raise

    def _connect_locked(self) -> None:
        s = self.settings
        store_class = import_store_class()
        problem = self._probe()
        if problem:
            raise TierUnavailableError(f"Mooncake is unreachable: {problem}")
        if is_loopback(s.local_hostname):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", s.local_hostname)
        if self._workers is None:
            self._workers = Workers(s.workers, "prefixd-mooncake")
        client = store_class()

        def setup() -> int:
            return int(
                client.setup(
                    s.local_hostname,
                    s.metadata,
                    s.segment_bytes,
                    s.buffer_bytes,
                    s.protocol,
                    s.device,
                    s.master,
                )
            )

        deadline = time.monotonic() + s.timeout_s
        try:
            future = self._start("setup", setup, deadline)
        except TierError:
            abandon(client, lambda: self._in_flight)
            raise
        try:
            rc = self._outcome("setup", future, deadline)
        except TierUnavailableError:
            if future.done():
                abandon(client, lambda: self._in_flight)
                raise
            # Mooncake's setup goes on and may mount the client's segment in the master's pool:
            # others would place values there that this tier never serves, lost with the client
            # when it is replaced. Such a client becomes the tier's when it answers.
            self._late_setup = future
            future.add_done_callback(lambda done: self._setup_answered(client, done))
            if self._client is client:  # it answered just now, the callback run here
                return
            raise
        except TierError:
            abandon(client, lambda: self._in_flight)
            raise
        if rc != 0:
            abandon(client, lambda: self._in_flight)
            raise TierUnavailableError(
                f"Mooncake setup (master {s.master}, metadata {s.metadata}) failed: "
                f"{code_name(rc)}",
                rc,
            )
        self._client = client
        log.info("connected to Mooncake master %s as %s", s.master, s.local_hostname)

    def _setup_answered(self, client: Any, future: Future[int]) -> None:
        """A setup that outlived its timeout has answered: its client is the tier's if it
        connected and the tier has none yet, else abandoned."""
        with self._connect_lock:
            self._late_setup = None
            connected = future.exception() is None and future.result() == 0
            if connected and self._client is None and not self._closed:
                self._client = client
                self._down_until = 0.0  # the cooldown its timeout began is over
                log.info(
                    "connected to Mooncake master %s as %s (its setup answered late)",
                    self.settings.master,
                    self.settings.local_hostname,
                )
                return
        abandon(client, lambda: self._in_flight)

    def close(self) -> None:
        """Disconnect (idempotent). Mooncake's close holds the GIL for seconds when the master is
        gone: then, or with calls still hanging, the client is abandoned instead
        (`close_abandoned`)."""
        with self._connect_lock:
            if self._closed:
                return
            self._closed = True
            client, self._client = self._client, None
        workers = self._workers
        if client is None:
            if workers is not None:
                workers.shutdown()
            return
        deadline = time.monotonic() + self.settings.timeout_s
        held = 0
        while held < self.settings.workers and self._slots.acquire(
            timeout=max(0.0, deadline - time.monotonic())
        ):
            held += 1
        problem = self._probe()
        if held < self.settings.workers or problem or workers is None:
            log.warning(
                "abandoning the Mooncake client without closing it (%s)",
                problem or "calls still running",
            )
            abandon(client, lambda: self._in_flight)
        else:
            with self._in_flight_lock:
                self._in_flight += 1
            future = workers.submit(client.close)
            future.add_done_callback(self._close_finished)
            try:
                future.result(timeout=max(5.0, self.settings.timeout_s))
            except FutureTimeoutError:
                log.warning("Mooncake close did not finish in time; abandoning the client")
                abandon(client, lambda: self._in_flight)
            except Exception as e:  # noqa: BLE001 - closing is best effort
                log.warning("Mooncake close failed: %s", e)
        for _ in range(held):
            self._slots.release()
        if workers is not None:
            workers.shutdown()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def put(
        self, key: str, value: bytes | bytearray | memoryview, *, overwrite: bool = False
    ) -> None:
        """Store `value` (non-empty, C-contiguous) under `key`; without `overwrite` an existing key
        keeps its value (objects are content-addressed)."""
        check_key(key)
        array, address, n = bytes_view(value, writable=False)
        if n == 0:
            raise TierValueError("the value is empty (Mooncake refuses empty objects)")
        call: Callable[[Any], int]
        if self._direct(address, n):

            def direct(client: Any, _pin: np.ndarray = array) -> int:  # _pin: memory stays alive
                fn = client.upsert_from if overwrite else client.put_from
                return put_placed(client, fn, key, address, n)

            call = direct
        else:
            if n > self.settings.buffer_bytes:
                raise TierValueError(
                    f"the value is {n} bytes, more than the staging buffer "
                    f"({self.settings.buffer_bytes}); register the buffer first"
                )

            def staged(client: Any) -> int:
                fn = client.upsert if overwrite else client.put
                return put_placed(client, fn, key, array)

            call = staged

        rc = self._call(f"put {tag(key)}", call)
        if rc != 0:
            raise failure(f"put {tag(key)} ({n} bytes)", rc)

    def get(self, key: str) -> bytes | None:
        check_key(key)
        direct = self.settings.protocol == "tcp"

        def call(client: Any) -> bytes | None:
            data = client.get(key)
            if data:
                return bytes(data)
            # b"" is both "missing" and "failed" (empty values cannot exist): ask the size.
            size = int(client.get_size(key))
            if size == NOT_FOUND:
                return None
            if size < 0:
                raise failure(f"get {tag(key)}", size)
            if not direct:
                raise TierError(f"get {tag(key)} ({size} bytes) failed through the staging buffer")
            out = bytearray(size)
            array = np.frombuffer(out, dtype=np.uint8)
            rc = int(client.get_into(key, int(array.ctypes.data), size))
            if rc == NOT_FOUND:
                return None
            if rc < 0:
                raise failure(f"get {tag(key)}", rc)
            return bytes(out) if rc == size else bytes(memoryview(out)[:rc])

        return self._call(f"get {tag(key)}", call)

    def get_into(self, key: str, buffer: bytearray | memoryview | Any) -> int | None:
        """Copy the value under `key` into the start of `buffer`; its length, or None when missing.
        After a TierUnavailableError the buffer may still be written: see `in_flight`."""
        check_key(key)
        array, address, n = bytes_view(buffer, writable=True)
        direct = self._direct(address, n)

        def call(client: Any) -> int | None:
            if direct:  # `array` (referenced below) keeps the buffer alive while Mooncake writes
                rc = int(client.get_into(key, address, n))
            else:
                data = client.get(key)
                if data and len(data) <= n:
                    array[: len(data)] = np.frombuffer(data, dtype=np.uint8)
                    return len(data)
                rc = INVALID_PARAMS if data else NOT_FOUND
            if rc >= 0:
                return rc
            if rc == NOT_FOUND or rc == INVALID_PARAMS:
                size = int(client.get_size(key))
                if size == NOT_FOUND:
                    return None
                if size > n:
                    raise TierValueError(
                        f"get_into {tag(key)}: the value is {size} bytes, the buffer {n}", rc
                    )
                if size < 0:
                    raise failure(f"get_into {tag(key)}", size)
            raise failure(f"get_into {tag(key)}", rc)

        return self._call(f"get_into {tag(key)}", call)

    def get_many_into(
        self, keys: Sequence[str], buffer: bytearray | memoryview | Any, capacity: int
    ) -> list[int | None]:
        """`get_into` for many keys in one round trip: key i's value goes to `buffer[i *
        capacity:]`. Per key its length, None when missing, -1 when longer than `capacity` (fetch
        that one alone). Direct (TCP, or a registered buffer) only."""
        names = [check_key(k) for k in keys]
        array, address, n = bytes_view(buffer, writable=True)
        if capacity <= 0 or len(names) * capacity > n:
            raise ValueError(f"{len(names)} values of {capacity} bytes do not fit {n} bytes")
        if not self._direct(address, n):
            raise TierError("get_many_into needs TCP or a registered buffer")
        if not names:
            return []
        addresses = [address + i * capacity for i in range(len(names))]
        sizes = [capacity] * len(names)

        def call(client: Any, _pin: np.ndarray = array) -> list[int]:  # _pin: memory stays alive
            return [int(c) for c in client.batch_get_into(names, addresses, sizes)]

        what = f"get_many_into ({len(names)} keys)"
        codes = self._call(what, call)
        if len(codes) != len(names):
            raise TierError(f"{what}: {len(codes)} answers for {len(names)} keys")
        for code in codes:
            if code < 0 and code not in (NOT_FOUND, INVALID_PARAMS):
                raise failure(what, code)
        # INVALID_PARAMS: longer than `capacity`
        return [c if c >= 0 else None if c == NOT_FOUND else -1 for c in codes]

    def size(self, key: str) -> int | None:
        check_key(key)
        rc = self._code(f"size {tag(key)}", lambda client: int(client.get_size(key)), NOT_FOUND)
        return None if rc == NOT_FOUND else rc

    def exists(self, key: str) -> bool:
        """Whether `key` has a value (this grants the key a read lease)."""
        check_key(key)
        return self._code(f"exists {tag(key)}", lambda client: int(client.is_exist(key))) == 1

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        names = [check_key(k) for k in keys]
        if not names:
            return []
        codes = self._call(
            f"exists_many ({len(names)} keys)",
            lambda client: [int(c) for c in client.batch_is_exist(names)],
        )
        if len(codes) != len(names):
            raise TierError(f"exists_many: {len(codes)} answers for {len(names)} keys")
        failed = [c for c in codes if c < 0]
        if failed:
            raise failure(f"exists_many ({len(failed)} of {len(names)} keys)", failed[0])
        return [c == 1 for c in codes]

    def remove(self, key: str, *, force: bool = True) -> bool:
        """Remove `key`; False when it was not there. Forced by default: a reader mid-transfer may
        then get torn bytes, which prefixd's end-to-end checksums reject, where an unforced remove
        fails on a key read in the last lease TTL (TierBusyError)."""
        check_key(key)
        rc = self._call(f"remove {tag(key)}", lambda client: int(client.remove(key, force)))
        if rc == 0:
            return True
        if rc == NOT_FOUND:
            return False
        raise failure(f"remove {tag(key)}", rc)

    def remove_prefix(self, prefix: str, *, force: bool = True) -> int:
        """Remove every key starting with `prefix` (non-empty: the pool is shared); the number
        removed. The master scans all its keys: for purges, not a hot path."""
        check_key(prefix)
        pattern = "^" + escape_regex(prefix)
        what = f"remove_prefix {tag(prefix)}"
        return self._code(what, lambda client: int(client.remove_by_regex(pattern, force)))

    def buffer(self, size: int) -> memoryview:
        """Plain memory, which this client writes into directly on TCP (ChildTier gives shared
        memory instead)."""
        return memoryview(bytearray(size))

    def release(self, view: memoryview) -> None:
        """Nothing to give back: see `buffer`."""

    def register(self, buffer: bytearray | memoryview | Any) -> None:
        """Register `buffer` for zero-copy calls (needed for RDMA); it stays registered, and alive,
        until the tier closes."""
        array, address, n = bytes_view(buffer, writable=True)
        rc = self._call("register", lambda client: int(client.register_buffer(address, n)))
        if rc != 0:
            raise failure(f"register ({n} bytes)", rc)
        with self._registered_lock:
            self._registered[address] = (n, array)

    def _direct(self, address: int, n: int) -> bool:
        if self.settings.protocol == "tcp":
            return True
        with self._registered_lock:
            return any(
                a <= address and address + n <= a + m for a, (m, _) in self._registered.items()
            )

    def _call(self, what: str, fn: Callable[[Any], T]) -> T:
        if self._closed:
            raise TierError(f"{what}: the shared tier is closed")
        self._check_cooldown()
        if self._client is None:
            self.connect()  # bounded on its own; the call then gets its full timeout
        client = self._client
        if client is None:  # closed concurrently
            raise TierError(f"{what}: the shared tier is closed")
        deadline = time.monotonic() + self.settings.timeout_s
        try:
            return self._submit(what, lambda: fn(client), deadline)
        except TierUnavailableError as e:
            self._trip(str(e))
            raise

    def _code(self, what: str, fn: Callable[[Any], int], allowed: int = 0) -> int:
        """A call's return code; its failure when negative (but `allowed`)."""
        rc = self._call(what, fn)
        if rc < 0 and rc != allowed:
            raise failure(what, rc)
        return rc

    def _submit(self, what: str, fn: Callable[[], T], deadline: float) -> T:
        """Run `fn` on a worker; a TierError instead of a hang or of Mooncake's exception."""
        return self._outcome(what, self._start(what, fn, deadline), deadline)

    def _start(self, what: str, fn: Callable[[], T], deadline: float) -> Future[T]:
        """`fn` running on a worker, once one is free before `deadline`."""
        workers = self._workers
        assert workers is not None
        if not self._slots.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TierUnavailableError(
                f"{what}: all {self.settings.workers} Mooncake workers are busy (calls hanging?)"
            )
        with self._in_flight_lock:
            self._in_flight += 1
        future = workers.submit(fn)
        future.add_done_callback(self._finished)
        return future

    def _outcome(self, what: str, future: Future[T], deadline: float) -> T:
        """`future`'s result by `deadline`; a TierError instead of a hang or of Mooncake's
        exception."""
        try:
            return future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeoutError:
            raise TierUnavailableError(
                f"{what}: no answer within {self.settings.timeout_s} s (Mooncake master "
                f"{self.settings.master} down or hung?)"
            ) from None
        except TierError:
            raise
        except Exception as e:
            raise TierError(f"{what}: {type(e).__name__}: {e}") from e

    def _finished(self, _: Future[Any]) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1
        self._slots.release()

    def _close_finished(self, _: Future[Any]) -> None:
        with self._in_flight_lock:
            self._in_flight -= 1

    def _probe(self) -> str:
        """Why the master or the HTTP metadata server cannot be reached ('' when both answer):
        Mooncake's setup against an unreachable master holds the GIL."""
        s = self.settings
        limit = min(1.0, s.timeout_s)
        try:
            with socket.create_connection(s.master_host_port, timeout=limit):
                pass
        except OSError as e:
            return f"master {s.master}: {e}"
        if s.metadata.startswith(("http://", "https://")):
            url = s.metadata + ("&" if "?" in s.metadata else "?") + "key=prefixd-probe"
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            try:
                with opener.open(url, timeout=limit):
                    pass
            except urllib.error.HTTPError:
                pass  # an answer (404: no such key) is all we ask for
            except (OSError, ValueError) as e:
                return f"metadata server {s.metadata}: {e}"
        return ""

    def _check_cooldown(self) -> None:
        if time.monotonic() < self._down_until:
            raise TierUnavailableError(f"shared tier unavailable ({self._down_reason})")

    def _trip(self, reason: str) -> None:
        self._down_reason = reason
        self._down_until = time.monotonic() + self.settings.cooldown_s


def open_tier(**settings: Any) -> SharedTier:
    """The tier prefixd.cluster.tier_child runs."""
    return SharedTier(MooncakeSettings(**settings))


__all__ = ["MooncakeSettings", "SharedTier", "open_tier"]
