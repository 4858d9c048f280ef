"""The three systemd protocols the daemon speaks: sd_notify, the watchdog, socket activation.

They are implemented here with the socket module alone, so prefixd needs neither libsystemd nor the
`systemd` Python package. Each function reads os.environ unless given a mapping, which keeps them
testable without systemd. Semantics follow libsystemd's sd_notify(3), sd_watchdog_enabled(3) and
sd_listen_fds(3) unless a docstring says otherwise.
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
# A send blocks only when systemd's notify queue is full; bound it so a watchdog ping sent from
# the event loop can never stall the loop for long.
NOTIFY_SEND_TIMEOUT_S = 0.5
# libsystemd parses these as plain unsigned decimals; int() alone would also take "+1", " 1", "1_0".
_UNSIGNED = re.compile(r"[0-9]+")


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def _unsigned(text: str | None) -> int | None:
    """Parse a plain unsigned decimal, or None: systemd never writes anything else."""
    if text is None or not _UNSIGNED.fullmatch(text):
        return None
    return int(text)


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, as RELOADING=1 carries it (sd_notify(3))."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send `state` (e.g. "READY=1\\nSTATUS=serving", "WATCHDOG=1", "STOPPING=1") to $NOTIFY_SOCKET.

    One AF_UNIX SOCK_DGRAM datagram; a leading '@' names the abstract namespace. Returns False,
    doing nothing, when NOTIFY_SOCKET is unset (not run by systemd, or Type= is not notify). A
    failed send is logged at debug and returns False instead of raising: losing a status line must
    never take the daemon down, and a lost READY=1 or WATCHDOG=1 is reported by systemd anyway.
    """
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
    """A STATUS= line carrying `text` on one line (a newline would start another assignment)."""
    return "STATUS=" + " ".join(text.split())


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of $WATCHDOG_USEC, as sd_watchdog_enabled(3) advises.

    None when the watchdog is off: WATCHDOG_USEC unset, zero or unparsable, or WATCHDOG_PID set to
    anything but this process (the variables were inherited from a parent that is supervised).
    """
    values = _env(env)
    usec = _unsigned(values.get("WATCHDOG_USEC"))
    if not usec:
        return None
    if "WATCHDOG_PID" in values and _unsigned(values["WATCHDOG_PID"]) != os.getpid():
        return None
    return usec / 2 / 1_000_000


def activated(env: Mapping[str, str] | None = None) -> bool:
    """Whether systemd passed this process its sockets (LISTEN_PID is ours), without taking
    them."""
    values = os.environ if env is None else env
    return _unsigned(values.get("LISTEN_PID")) == os.getpid()


def listen_sockets(
    env: MutableMapping[str, str] | None = None, *, unset: bool = True
) -> list[socket.socket]:
    """The sockets passed by socket activation, in the order of the socket unit's Listen* lines.

    Like sd_listen_fds(3), this requires $LISTEN_PID to be present and equal to this process: an
    absent or foreign LISTEN_PID means the variables were inherited, not meant for us, and the fds
    3.. may be anything, so they are left untouched and the result is empty. Each fd is marked
    close-on-exec (children must not hold the listening socket open) and wrapped in
    socket.socket(fileno=fd), which reads family and type from the fd itself. With unset=True the
    LISTEN_* variables are removed from `env` whatever the outcome, so no child acts on them.

    Raises ConfigError when LISTEN_PID is ours but LISTEN_FDS is unparsable or names an fd that is
    not an open socket: systemd says we were activated, so silently binding elsewhere would hide it.
    """
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
    """Pings WATCHDOG=1 every interval from the asyncio loop while a health check passes.

    Running on the loop itself is the point: a wedged loop stops the pings and systemd restarts
    the daemon. The health check covers what a live loop does not prove (e.g. the store still
    answers); it gets one interval to answer, and a check that fails, raises or overruns skips that
    ping, so systemd (WatchdogSec = two intervals) acts after about two bad checks in a row.
    A store whose fsync failed still passes: it serves reads, and the daemon reports the failure
    in STATUS= instead of being restarted (see Server._report_sync_failure).
    """

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
        """Until cancelled: check health, ping if it passed, sleep out the rest of the interval."""
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
        """True only when healthy() returns True within one interval; never raises but on cancel."""
        try:
            async with asyncio.timeout(self._interval_s):
                return bool(await self._healthy())
        except Exception:
            log.debug("watchdog health check raised", exc_info=True)
            return False
