"""One engine plug-in's connection to the daemon: made on first use, dropped when lost, made again
`reconnect_s` later. The engines' tiers (vLLM, LMCache, SGLang) treat a daemon that is away as a
miss, never as an error in the engine's way."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from prefixd.client import Client, DaemonUnavailableError, RequestTimeoutError
from prefixd.errors import PrefixdError

log = logging.getLogger(__name__)

T = TypeVar("T")


class DaemonLink:
    """A lazily connected `Client`; `label` names the plug-in in logs (never keys or tokens)."""

    def __init__(
        self,
        socket: str,
        *,
        region_bytes: int,
        timeout_s: float,
        name: str,
        label: str,
        reconnect_s: float = 0.0,
        daemon_uid: int | None = None,
    ) -> None:
        self._socket = socket
        self._region_bytes = region_bytes
        self._timeout_s = timeout_s
        self._name = name
        self._label = label
        self._reconnect_s = reconnect_s
        self._daemon_uid = daemon_uid
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._next_connect = 0.0

    @property
    def connected(self) -> bool:
        return self._client is not None

    def client(self) -> Client | None:
        """The connection, made now if there is none and the back-off has passed; None while
        the daemon is away."""
        with self._lock:
            if self._client is not None:
                return self._client
            now = time.monotonic()
            if now < self._next_connect:
                return None
            try:
                self._client = Client(
                    self._socket,
                    region_bytes=self._region_bytes,
                    timeout=self._timeout_s,
                    name=self._name,
                    daemon_uid=self._daemon_uid,
                )
            except (PrefixdError, OSError) as exc:
                self._next_connect = now + self._reconnect_s
                log.warning("%s: daemon at %s not reachable (%s)", self._label, self._socket, exc)
                return None
            return self._client

    def call(self, operation: Callable[[Client], T]) -> T | None:
        """`operation(client)`, or None when the daemon is away or refuses it."""
        client = self.client()
        if client is None:
            return None
        try:
            return operation(client)
        except PrefixdError as exc:
            self.failed(client, exc)
            return None

    def failed(self, client: Client, exc: PrefixdError) -> None:
        """Log a refused call by its class and code; drop the connection if it was lost."""
        log.info("%s: %s (%s)", self._label, type(exc).__name__, getattr(exc, "code", ""))
        if isinstance(exc, DaemonUnavailableError | RequestTimeoutError):
            with self._lock:
                if self._client is client:
                    self._client = None
                    self._next_connect = time.monotonic() + self._reconnect_s
            client.close()

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()


__all__ = ["DaemonLink"]
