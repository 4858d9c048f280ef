"""One engine plug-in's connection to the daemon: made on first use, made again `reconnect_s`
after a loss. A daemon that is away is a miss, never an error in the engine's way; but an engine
at 0 % hits must hear why, so each distinct problem is logged at ERROR with its fix (then at most
once a LOG_EVERY_S) and `status()` reports it. Logs never name prompts, token ids or keys.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from prefixd.client import Client, DaemonUnavailableError, RequestTimeoutError
from prefixd.errors import (
    BadRequestError,
    BusyError,
    ConfigError,
    ForbiddenError,
    OrphanBlockError,
    PrefixdError,
    RegionError,
    RegionFullError,
    ShuttingDownError,
    StoreFullError,
    StoreWriteError,
    UnsupportedVersionError,
    UntrustedDaemonError,
)
from prefixd.trust import DAEMON_USER_VARIABLE, DENIED_FIX, access_problem, user_name

log = logging.getLogger(__name__)

T = TypeVar("T")

LOG_EVERY_S = 60.0  # a problem already logged is logged again at most this often

# The kinds of problem, each with its own fix (Problem.kind).
UNREACHABLE = "unreachable"  # no socket, nothing listening, the connection lost
DENIED = "denied"  # this user may not enter the socket's directory or connect to the socket
UNTRUSTED = "untrusted"  # the socket or the process serving it is not the daemon's user's
FORBIDDEN = "forbidden"  # the daemon refuses this user, or this tenant
REGION = "region"  # the shared region cannot be made, attached or fit a transfer
TIMEOUT = "timeout"  # no reply within timeout_s
REFUSED = "refused"  # the daemon refused one call for another reason
KINDS = (UNREACHABLE, DENIED, UNTRUSTED, FORBIDDEN, REGION, TIMEOUT, REFUSED)

START_FIX = (
    "start the daemon: systemctl start prefixd.socket (prefixd@NAME.socket for an instance), "
    "or check --socket: the adapter's socket must be the one the daemon serves "
    "(`prefixd serve --print-config` shows it)"
)


@dataclass(frozen=True)
class Problem:
    """Why the daemon could not be used, as this process sees it, and what fixes it."""

    kind: str  # one of KINDS
    error: str  # the exception's class name
    message: str  # what went wrong: paths, users, codes; never keys or tokens
    fix: str

    @property
    def unusable(self) -> bool:
        """Whether the daemon is unusable (every call a miss until fixed), not one call refused."""
        return self.kind != REFUSED


def diagnose(
    exc: BaseException, *, socket: str | os.PathLike[str], region_bytes: int, timeout_s: float
) -> Problem:
    """The Problem `exc` shows, raised by connecting a Client to `socket` or by a call on one
    (`prefixd doctor` reads errors the same way)."""
    name = type(exc).__name__
    path = Path(socket)
    if isinstance(exc, UntrustedDaemonError):
        fix = (
            ""
            if DAEMON_USER_VARIABLE in str(exc)
            else (
                f"if the daemon runs as another user, name it: {DAEMON_USER_VARIABLE}=<user> "
                "(or the adapter's daemon_uid)"
            )
        )
        return Problem(UNTRUSTED, name, str(exc), fix)
    if isinstance(exc, ForbiddenError):
        return Problem(FORBIDDEN, name, _refusal(exc), forbidden_fix(str(exc)))
    if isinstance(exc, RequestTimeoutError):
        return Problem(
            TIMEOUT,
            name,
            f"the daemon at {path} did not answer within timeout_s={timeout_s:g}",
            f"check it with `prefixd health --socket {path}` and `prefixd stats`; if the node is "
            "only busy, raise the adapter's timeout_s",
        )
    if isinstance(exc, ShuttingDownError):
        return Problem(UNREACHABLE, name, f"the daemon at {path} is shutting down", START_FIX)
    if isinstance(exc, DaemonUnavailableError):
        if access_problem(path) is not None:
            return _denied(name, path, str(exc))
        fix = "" if "systemctl start" in str(exc) else START_FIX  # the client's message has it
        return Problem(UNREACHABLE, name, f"cannot reach the daemon: {exc}", fix)
    if isinstance(exc, RegionFullError):
        return Problem(
            REGION,
            name,
            f"a transfer does not fit the shared region ({exc})",
            f"raise the adapter's region_bytes (now {region_bytes}) above the largest transfer",
        )
    if isinstance(exc, BadRequestError) and "attach" in str(exc):
        return Problem(
            REGION,
            name,
            f"the daemon refused a shared region of region_bytes={region_bytes} ({exc})",
            "lower the adapter's region_bytes, or raise the daemon's max_region_bytes",
        )
    if isinstance(exc, RegionError):
        return Problem(REGION, name, f"the shared region was refused ({exc})", _REGION_FIX)
    if isinstance(exc, BusyError):
        return Problem(
            REFUSED,
            name,
            f"the daemon is at its limit of connections or requests ({exc})",
            "raise the daemon's max_connections / max_connections_per_uid, or run fewer clients",
        )
    if isinstance(exc, UnsupportedVersionError):
        return Problem(
            REFUSED,
            name,
            str(exc),
            "install the prefixd release the daemon runs in the engine's environment",
        )
    if isinstance(exc, ConfigError):  # a daemon user that names no account, say
        return Problem(UNTRUSTED, name, str(exc), "name the daemon's user by a user name or uid")
    if isinstance(exc, StoreFullError | StoreWriteError):
        return Problem(
            REFUSED,
            name,
            f"the daemon's store refuses writes ({name}); lookups and loads go on",
            f"`prefixd health --socket {path}` and the daemon's log say why (a full disk, a "
            "failed fsync)",
        )
    if isinstance(exc, PrefixdError):  # the message may quote a field: the class and code only
        code = getattr(exc, "code", "")
        return Problem(
            REFUSED,
            name,
            f"the daemon refused a call ({name}, code {getattr(code, 'value', code)})",
            "the daemon's log (journalctl -u prefixd) says why",
        )
    if isinstance(exc, OSError):
        if exc.errno in (errno.EACCES, errno.EPERM):
            return _denied(name, path, str(exc))
        if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ECONNREFUSED):
            return Problem(
                UNREACHABLE, name, f"cannot reach the daemon at {path}: {exc}", START_FIX
            )
        return Problem(
            REGION,
            name,
            f"cannot create the shared region of region_bytes={region_bytes} ({exc})",
            _REGION_FIX,
        )
    return Problem(REFUSED, name, f"unexpected {name}: {exc}", "see the engine's log")


_REGION_FIX = (
    "lower the adapter's region_bytes, or give the engine more memory (the region is shared "
    "memory the engine maps in full: it counts against its cgroup's MemoryMax)"
)


def forbidden_fix(message: str) -> str:
    """How to let this process's user in: to the daemon, or to the tenant it was refused."""
    uid, user = os.geteuid(), user_name(os.geteuid())
    if "tenant" in message:
        return (
            f"grant the tenant to {user} in the daemon's tenant_policy (uid:{uid}=TENANT or "
            "gid:GID=TENANT), or set the adapter's tenant to one it is granted; then "
            "`systemctl reload prefixd`"
        )
    return (
        f"add the engine's user {user} to group prefixd (the daemon's group under the shipped "
        f"unit: usermod -aG prefixd {user}), or to the daemon's allowed_uids / allowed_gids; "
        "confine it to some tenants with tenant_policy. Then restart the engine (and "
        "`systemctl reload prefixd` for a changed setting)"
    )


def _refusal(exc: ForbiddenError) -> str:
    who = f"{user_name(os.geteuid())} (uid {os.geteuid()})"
    return f"the daemon refused {who}: {getattr(exc, 'message', '') or exc}"


def _denied(name: str, path: Path, detail: str) -> Problem:
    found = access_problem(path)
    if found is None:
        return Problem(DENIED, name, f"permission denied on {path}: {detail}", DENIED_FIX)
    return Problem(DENIED, name, found[0], found[1])


@dataclass
class _Reported:
    """When a distinct problem was last logged, and how many repeats were held back since."""

    at: float
    held: int = 0


class DaemonLink:
    """A lazily connected `Client`; `label` names the plug-in in logs (never keys or tokens).
    `clock` (seconds, monotonic) times reconnects and the logs' rate limit; tests pass their own."""

    def __init__(
        self,
        socket: str,
        *,
        region_bytes: int,
        timeout_s: float,
        name: str,
        label: str,
        reconnect_s: float = 0.0,
        daemon_uid: int | str | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._socket = socket
        self._region_bytes = region_bytes
        self._timeout_s = timeout_s
        self._name = name
        self._label = label
        self._reconnect_s = reconnect_s
        self._daemon_uid = daemon_uid
        self._clock = clock
        self._client: Client | None = None
        self._lock = threading.Lock()
        self._next_connect = 0.0
        # calls under way on each client (by id): a client dropped while another thread's call
        # still uses it is closed when the last of them ends, never under it
        self._users: dict[int, int] = {}
        self._dropped: dict[int, Client] = {}
        # what status() reports, under its own lock (calls fail on several threads at once)
        self._state_lock = threading.Lock()
        self._failures = dict.fromkeys(KINDS, 0)
        self._unusable_calls = 0
        self._last: tuple[Problem, float] | None = None
        self._reported: dict[tuple[str, str], _Reported] = {}
        self._failing = False  # a problem since the last connection (its end is logged)

    @property
    def connected(self) -> bool:
        return self._client is not None

    def client(self) -> Client | None:
        """The connection, made now if there is none and the back-off has passed."""
        with self._lock:
            if self._client is not None:
                return self._client
            now = self._clock()
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
                self._note(exc, connecting=True)
                return None
            client = self._client
        self._connected_again()
        return client

    def call(self, operation: Callable[[Client], T]) -> T | None:
        """`operation(client)`, or None when the daemon is away or refuses it."""
        client = self.client()
        if client is None:
            self._count_unusable()
            return None
        with self._lock:
            self._users[id(client)] = self._users.get(id(client), 0) + 1
        try:
            return operation(client)
        except PrefixdError as exc:
            if self.failed(client, exc).unusable:
                self._count_unusable()
            return None
        finally:
            with self._lock:
                left = self._users.pop(id(client)) - 1
                if left:
                    self._users[id(client)] = left
                closing = None if left else self._dropped.pop(id(client), None)
            if closing is not None:
                closing.close()

    def failed(self, client: Client, exc: PrefixdError) -> Problem:
        """Report a refused call; drop the connection if it was lost (closed once no call is
        under way on it)."""
        problem = self._note(exc, connecting=False)
        if isinstance(exc, DaemonUnavailableError | RequestTimeoutError):
            with self._lock:
                if self._client is client:
                    self._client = None
                    self._next_connect = self._clock() + self._reconnect_s
                in_use = bool(self._users.get(id(client)))
                if in_use:
                    self._dropped[id(client)] = client
            if not in_use:
                client.close()
        return problem

    def status(self) -> dict[str, Any]:
        """For the adapter's stats; `unusable_calls` counts the calls answered as misses (or
        failed stores) because the daemon could not be used."""
        with self._state_lock:
            last = None
            if self._last is not None:
                problem, at = self._last
                last = {
                    "kind": problem.kind,
                    "error": problem.error,
                    "message": problem.message,
                    "fix": problem.fix,
                    "age_s": round(self._clock() - at, 3),
                }
            return {
                "socket": self._socket,
                "connected": self.connected,
                "unusable_calls": self._unusable_calls,
                "failures": dict(self._failures),
                "last_problem": last,
            }

    def close(self) -> None:
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    # --- reporting ------------------------------------------------------------------------------

    def _note(self, exc: BaseException, *, connecting: bool) -> Problem:
        """Count the failure and log it, unless the same problem was logged lately."""
        problem = diagnose(
            exc, socket=self._socket, region_bytes=self._region_bytes, timeout_s=self._timeout_s
        )
        now = self._clock()
        key = (problem.kind, problem.error)
        with self._state_lock:
            self._failures[problem.kind] += 1
            self._last = (problem, now)
            self._failing = True
            reported = self._reported.get(key)
            if reported is not None and now - reported.at < LOG_EVERY_S:
                reported.held += 1
                return problem
            held, since = (0, 0.0) if reported is None else (reported.held, now - reported.at)
            self._reported[key] = _Reported(now)
        # A race with eviction (a parent gone between lookup and put) is no fault of the setup.
        level = logging.WARNING if isinstance(exc, OrphanBlockError) else logging.ERROR
        consequence = (
            "every lookup is a miss until it is fixed"
            if connecting or problem.unusable
            else "the call was answered as a miss"
        )
        repeats = f" ({held} more times in the last {since:.0f} s)" if held else ""
        fix = f". Fix: {problem.fix}" if problem.fix else ""
        log.log(level, "%s: %s; %s%s%s", self._label, problem.message, consequence, repeats, fix)
        return problem

    def _connected_again(self) -> None:
        with self._state_lock:
            was_failing, self._failing = self._failing, False
            self._reported.clear()  # a problem that comes back is news again
        if was_failing:
            log.warning("%s: connected to the daemon at %s again", self._label, self._socket)

    def _count_unusable(self) -> None:
        with self._state_lock:
            self._unusable_calls += 1


__all__ = ["KINDS", "START_FIX", "DaemonLink", "Problem", "diagnose", "forbidden_fix"]
