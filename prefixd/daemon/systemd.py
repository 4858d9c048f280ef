"""The systemd protocols the daemon speaks (sd_notify, the watchdog, socket activation) with the
socket module alone: neither libsystemd nor the `systemd` package is needed. Semantics follow
sd_notify(3), sd_watchdog_enabled(3) and sd_listen_fds(3); `env` defaults to os.environ.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping

from prefixd.errors import ConfigError

log = logging.getLogger(__name__)

# The first fd passed by socket activation (SD_LISTEN_FDS_START): 0-2 are stdio.
LISTEN_FDS_START = 3
# The variables socket activation sets; removed after use so children do not claim the fds.
LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# A send blocks when systemd's queue is full: a watchdog ping must not stall the loop long
NOTIFY_SEND_TIMEOUT_S = 0.5
# libsystemd parses these as plain unsigned decimals; int() alone would also take "+1", " 1", "1_0".
_UNSIGNED = re.compile(r"[0-9]+")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _unsigned(text: str | None) -> int | None:
    if text is None or not _UNSIGNED.fullmatch(text):
        return None
    return int(text)


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, as RELOADING=1 carries it."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send `state` to $NOTIFY_SOCKET; False when unset or when the send fails (logged at debug): a
    lost status line must never take the daemon down."""
    if not state:
        raise ValueError("notify: state must not be empty")
    address = _env(env).get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        target = b"\0" + os.fsencode(address[1:])
    elif address.startswith("/"):
        target = os.fsencode(address)
    else:  # e.g. "vsock:..." (systemd >= 253): not used for a local daemon
        log.debug("sd_notify: unsupported NOTIFY_SOCKET %r", address)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.settimeout(NOTIFY_SEND_TIMEOUT_S)
            sock.sendto(state.encode(), target)
    except OSError as exc:
        log.debug("sd_notify to %r failed: %s", address, exc)
        return False
    return True


def status(text: str) -> str:
    """A STATUS= line on one line (a newline would start another assignment)."""
    return "STATUS=" + " ".join(text.split())


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Half of $WATCHDOG_USEC in seconds; None when the watchdog is off or WATCHDOG_PID names
    another process (variables inherited from a supervised parent)."""
    values = _env(env)
    usec = _unsigned(values.get("WATCHDOG_USEC"))
    if not usec:
        return None
    if "WATCHDOG_PID" in values and _unsigned(values["WATCHDOG_PID"]) != os.getpid():
        return None
    return usec / 2 / 1_000_000


def activated(env: Mapping[str, str] | None = None) -> bool:
    """Whether systemd passed this process its sockets, without taking them."""
    values = os.environ if env is None else env
    return _unsigned(values.get("LISTEN_PID")) == os.getpid()


def listen_sockets(
    env: MutableMapping[str, str] | None = None, *, unset: bool = True
) -> list[socket.socket]:
    """The sockets passed by socket activation, close-on-exec. Foreign or absent LISTEN_PID:
    inherited variables, the fds are left alone. ConfigError when LISTEN_PID is ours but the fds are
    not usable sockets: binding elsewhere would hide it. `unset` removes LISTEN_* so no child acts
    on them."""
    values: MutableMapping[str, str] = os.environ if env is None else env
    try:
        if _unsigned(values.get("LISTEN_PID")) != os.getpid():
            return []
        count = _unsigned(values.get("LISTEN_FDS"))
        if count is None:
            raise ConfigError(f"LISTEN_FDS: expected a count, got {values.get('LISTEN_FDS')!r}")
        sockets: list[socket.socket] = []
        try:
            for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + count):
                os.set_inheritable(fd, False)
                sockets.append(socket.socket(fileno=fd))
        except OSError as exc:
            for sock in sockets:
                sock.detach()  # leave the fds as found; systemd still owns its copies
            raise ConfigError(f"LISTEN_FDS={count}: fd {fd} is not a usable socket: {exc}") from exc
        return sockets
    finally:
        if unset:
            for name in LISTEN_VARS:
                values.pop(name, None)


class Watchdog:
    """Pings WATCHDOG=1 from the event loop while a health check passes: a wedged loop stops the
    pings and systemd restarts the daemon. A check that fails, raises or overruns an interval skips
    its ping. A failed fsync still passes (Server._report_sync_failure says why)."""

    def __init__(
        self,
        interval_s: float,
        healthy: Callable[[], Awaitable[bool]],
        env: Mapping[str, str] | None = None,
    ) -> None:
        valid = isinstance(interval_s, (int, float)) and math.isfinite(interval_s)
        if not (valid and interval_s > 0):
            raise ConfigError(f"watchdog interval: must be a positive number, got {interval_s!r}")
        self._interval_s = float(interval_s)
        self._healthy = healthy
        self._env = env
        self.pings = 0  # sent; for stats and tests
        self.skipped = 0  # withheld because the health check did not pass

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        was_healthy = True
        while True:
            started = loop.time()
            is_healthy = await self._check()
            if is_healthy:
                if notify("WATCHDOG=1", self._env):
                    self.pings += 1
                if not was_healthy:
                    log.info("health check passes again; watchdog pings resumed")
            else:
                self.skipped += 1
                if was_healthy:
                    log.warning("health check failed; withholding watchdog pings")
            was_healthy = is_healthy
            await asyncio.sleep(max(0.0, started + self._interval_s - loop.time()))

    async def _check(self) -> bool:
        """Whether healthy() returns True within one interval; raises only on cancel."""
        try:
            async with asyncio.timeout(self._interval_s):
                return bool(await self._healthy())
        except Exception:
            log.debug("watchdog health check raised", exc_info=True)
            return False
