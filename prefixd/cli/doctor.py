"""`prefixd doctor`: check a node from an engine's point of view, as the engine's user.

An engine that cannot reach, trust or use the daemon only misses; this command says why, in the
order an engine meets the problems: reach (the socket is there and this user may connect), trust
(the client's own checks of the socket, its directory and the serving process), the daemon's
acceptance of this user (hello), the tenant's policy (a lookup under it), a put, lookup, load and
delete round trip of a throwaway block (the loaded bytes must be the ones put), and the cost of
the shared region an engine's `Client(..., region_bytes=N)` makes when it connects. Each failed
check says what is wrong and how to fix it; the checks after a failed one are skipped.

`--as-user USER` (as root) runs the checks in a child process with that user's uid, gid and
supplementary groups, as an engine running as USER would connect. Exit codes: 0 every check
passed, 1 one failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from prefixd.cli.output import Output
from prefixd.errors import ConfigError

T = TypeVar("T")

DEFAULT_TENANT = "default"  # the adapters' default tenant
DEFAULT_REGION_BYTES = 64 << 20  # the vLLM tier's default region_bytes
CHECKS = ("reach", "trust", "accept", "tenant", "round_trip", "region")
BLOCK_TOKENS = 16
PAYLOAD_BYTES = 64 << 10
# What the checks import, loaded before --as-user drops to a user who may not read the interpreter
PRELOADED = (
    "socket",
    "stat",
    "struct",
    "time",
    "uuid",
    "numpy",
    "prefixd.client",
    "prefixd.integrations.link",
    "prefixd.schema.identity",
    "prefixd.trust",
)


@dataclass
class Check:
    """One check's outcome: `ok` None when skipped after an earlier failure."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""
    measured: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Account:
    """The user the checks run as."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]


def add_parser(commands: Any) -> None:
    """Register `doctor` among the CLI's subcommands (`commands`: argparse's subparsers)."""
    from prefixd.cli.arguments import add_daemon_arguments, positive
    from prefixd.store.config import parse_seconds, parse_size

    doctor = commands.add_parser(
        "doctor",
        help="check this node from an engine's point of view (as a given user)",
        description=__doc__.split("\n\n")[1].replace("\n", " ") if __doc__ else None,
        epilog="Exit codes: 0 every check passed, 1 a check failed, 2 bad arguments.",
    )
    add_daemon_arguments(doctor, data_dir=False)
    doctor.add_argument(
        "--as-user",
        metavar="USER",
        help="check as this user (a name or uid; needs root): its uid, gid and groups",
    )
    doctor.add_argument(
        "--tenant",
        default=DEFAULT_TENANT,
        help=f"the tenant the engine uses (default {DEFAULT_TENANT})",
    )
    doctor.add_argument(
        "--region-bytes",
        type=positive(parse_size, "a size (like 256MiB)", "bytes"),
        default=DEFAULT_REGION_BYTES,
        metavar="SIZE",
        help="the region_bytes the engine's adapter sets (default 64MiB): its cost is measured",
    )
    doctor.add_argument(
        "--timeout",
        type=positive(parse_seconds, "a number of seconds", "seconds"),
        default=10.0,
        metavar="SECONDS",
        help="per reply (default 10)",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON, for scripts")
    doctor.set_defaults(command=run)


def run(args: argparse.Namespace, out: Output) -> int:
    from prefixd.cli.arguments import daemon_config
    from prefixd.cli.endpoints import node_fallback

    config, given = daemon_config(args, os.environ)
    socket = node_fallback(config, given)  # as every command finds the node's daemon
    account = _account(args.as_user)

    def checks() -> list[Check]:
        return run_checks(
            socket,
            daemon_user=config.socket.daemon_user or None,
            tenant=args.tenant,
            region_bytes=args.region_bytes,
            timeout_s=args.timeout,
        )

    if account.uid == os.geteuid():
        results = checks()
    elif os.geteuid() != 0:
        raise ConfigError(f"--as-user {args.as_user}: only root may check as another user")
    else:
        results = _as(account, checks)
    report = {
        "socket": str(socket),
        "user": account.name,
        "uid": account.uid,
        "groups": list(account.groups),
        "ok": all(c.ok for c in results),
        "checks": [asdict(c) for c in results],
    }
    if out.as_json:
        out.json(report)
    else:
        _print(report, out)
    return 0 if report["ok"] else 1


# --- the checks ---------------------------------------------------------------------------------


def run_checks(
    socket: Path, *, daemon_user: str | None, tenant: str, region_bytes: int, timeout_s: float
) -> list[Check]:
    """Every check in order, as this process's user; after a failure the rest are skipped."""
    steps = zip(CHECKS, (_reach, _trust, _accept, _tenant, _round_trip, _region), strict=True)
    state = _State(socket, daemon_user, tenant, region_bytes, timeout_s)
    results: list[Check] = []
    try:
        for name, step in steps:
            failed = next((c.name for c in results if not c.ok), None)
            if failed is not None:
                results.append(Check(name, None, f"skipped: {failed} failed"))
                continue
            try:
                results.append(step(state))
            except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check
                results.append(_failed(name, exc, state))
    finally:
        if state.client is not None:
            state.client.close()
    return results


@dataclass
class _State:
    socket: Path
    daemon_user: str | None
    tenant: str
    region_bytes: int
    timeout_s: float
    client: Any = None  # the accepted connection (region-less), for the tenant check
    daemon_gid: int | None = None  # the serving process's primary group (SO_PEERCRED)


def _reach(state: _State) -> Check:
    """The socket is there, this user may enter its directories and connect; the connection
    is closed without a byte sent (trust is the next check's)."""
    import socket as sockets
    import stat

    from prefixd.integrations.link import START_FIX
    from prefixd.trust import access_problem

    path = state.socket
    denied = access_problem(path)
    if denied is not None:
        return Check("reach", False, denied[0], denied[1])
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        where = (
            f"no socket at {path}"
            if path.parent.is_dir()
            else f"no directory {path.parent}: no daemon has made its socket {path.name} there"
        )
        return Check("reach", False, where, START_FIX)
    if not stat.S_ISSOCK(info.st_mode):
        return Check("reach", False, f"{path} is not a socket", "check --socket")
    with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
        sock.settimeout(state.timeout_s)
        try:
            sock.connect(os.fspath(path))
        except ConnectionRefusedError:
            return Check(
                "reach", False, f"nothing listens on {path} (a stopped daemon's socket)", START_FIX
            )
    return Check("reach", True, f"{path} accepts connections ({_described(path)})")


def _trust(state: _State) -> Check:
    """The client's own checks: the socket and its directory, then the serving process."""
    import socket as sockets

    from prefixd.errors import UntrustedDaemonError
    from prefixd.integrations.link import diagnose
    from prefixd.trust import check_peer, check_socket_path, daemon_uids, user_name

    uids = daemon_uids(state.daemon_user)
    trusted = " or ".join(f"{user_name(u)} (uid {u})" for u in sorted(uids))
    try:
        check_socket_path(state.socket, uids)
        with sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM) as sock:
            sock.settimeout(state.timeout_s)
            sock.connect(os.fspath(state.socket))
            pid, uid, gid = check_peer(sock, uids)
    except UntrustedDaemonError as exc:
        problem = diagnose(exc, socket=state.socket, region_bytes=0, timeout_s=state.timeout_s)
        return Check("trust", False, problem.message, problem.fix)
    state.daemon_gid = gid
    return Check(
        "trust",
        True,
        f"the socket, its directory and the daemon (pid {pid}) belong to {user_name(uid)}, "
        f"a user trusted to run it ({trusted})",
        measured={"daemon_uid": uid, "daemon_gid": gid},
    )


def _accept(state: _State) -> Check:
    """The daemon takes this user: hello, with no region yet."""
    from prefixd.errors import ForbiddenError
    from prefixd.trust import group_name, user_name

    try:
        state.client = _client(state, 0)
    except ForbiddenError as exc:
        refusal = exc
    else:
        server = state.client.server
        return Check(
            "accept",
            True,
            f"the daemon ({server.get('server', 'prefixd')}, protocol {server.get('protocol')}) "
            f"accepts {user_name(os.geteuid())}",
            measured={"max_region_bytes": server.get("max_region_bytes")},
        )
    user = user_name(os.geteuid())
    group = "prefixd"
    if state.daemon_gid:  # the daemon's own group's members may connect
        group = group_name(state.daemon_gid)
    return Check(
        "accept",
        False,
        f"the daemon refuses {user} (uid {os.geteuid()}, groups {sorted(os.getgroups())}): "
        f"{getattr(refusal, 'message', '') or refusal}",
        f"add {user} to the daemon's group {group} (usermod -aG {group} {user}), or to its "
        "allowed_uids / allowed_gids (then `systemctl reload prefixd`); then start the engine "
        "again",
    )


def _tenant(state: _State) -> Check:
    """A lookup under the tenant: the daemon's tenant_policy lets this user use it."""
    from prefixd.errors import ForbiddenError
    from prefixd.integrations.link import forbidden_fix

    identity, tokens = _throwaway(state.tenant)
    try:
        state.client.lookup(identity, [tokens])
    except ForbiddenError as exc:
        return Check(
            "tenant",
            False,
            f"the daemon refuses tenant {state.tenant!r}: {exc.message or exc}",
            forbidden_fix(str(exc)).replace("TENANT", state.tenant),
        )
    return Check("tenant", True, f"tenant {state.tenant!r} may be used")


def _round_trip(state: _State) -> Check:
    """Put a throwaway block, find it, load it (the same bytes), delete it."""
    identity, tokens = _throwaway(state.tenant)
    payloads = [os.urandom(PAYLOAD_BYTES) for _ in range(2)]
    times: dict[str, float] = {}
    with _client(state, 4 * PAYLOAD_BYTES) as client:
        stored = _timed(times, "put_ms", lambda: client.put(identity, tokens, payloads))
        try:
            [found] = _timed(times, "lookup_ms", lambda: client.lookup(identity, [tokens]))
            with _timed(times, "load_ms", lambda: client.load(identity, tokens)) as loaded:
                same = [bytes(v) for v in loaded.views] == payloads
        finally:
            deleted = client.delete(identity, [tokens[:BLOCK_TOKENS]])  # and the one below
    if stored.stored + stored.existed != 2 or found.n_blocks != 2:
        return Check(
            "round_trip",
            False,
            f"put 2 blocks, the daemon stored {stored.stored} and finds {found.n_blocks}",
            "see the daemon's log (journalctl -u prefixd) and `prefixd health`",
            measured=times,
        )
    if not same:
        return Check(
            "round_trip",
            False,
            "the daemon loaded other bytes than were put",
            "stop the engines and run `prefixd verify --socket ...`; report it",
            measured=times,
        )
    return Check(
        "round_trip",
        True,
        f"put, found and loaded 2 blocks of {PAYLOAD_BYTES >> 10} KiB (the same bytes), then "
        f"deleted {deleted}",
        measured=times,
    )


def _region(state: _State) -> Check:
    """What an engine's `Client(..., region_bytes=N)` costs at connect: a sealed memfd of N
    bytes, touched in full (so N bytes of memory per engine process), attached by the daemon."""
    import time

    size = state.region_bytes
    available = _available_memory()
    if available is not None and size > available:
        return Check(
            "region",
            False,
            f"region_bytes={size} ({_human(size)}) is more than the memory available now "
            f"({_human(available)})",
            "lower the adapter's region_bytes",
        )
    limit = state.client.server.get("max_region_bytes") if state.client is not None else None
    if isinstance(limit, int) and size > limit:
        return Check(
            "region",
            False,
            f"region_bytes={size} is more than the daemon's max_region_bytes ({limit})",
            "lower the adapter's region_bytes, or raise the daemon's max_region_bytes",
        )
    started = time.perf_counter()
    with _client(state, size):
        seconds = time.perf_counter() - started
    return Check(
        "region",
        True,
        f"a region of {_human(size)} took {seconds:.2f} s to make and attach, and holds "
        f"{_human(size)} of memory in each engine process for as long as it is connected",
        measured={"region_bytes": size, "seconds": round(seconds, 4)},
    )


def _client(state: _State, region_bytes: int) -> Any:
    """A client as an engine's adapter makes one, with a region of `region_bytes` (0: none)."""
    from prefixd.client import Client

    return Client(
        state.socket,
        region_bytes=region_bytes,
        timeout=state.timeout_s,
        name="prefixd-doctor",
        daemon_uid=state.daemon_user,
    )


def _failed(name: str, exc: Exception, state: _State) -> Check:
    from prefixd.integrations.link import diagnose

    problem = diagnose(
        exc, socket=state.socket, region_bytes=state.region_bytes, timeout_s=state.timeout_s
    )
    message = problem.message
    if problem.kind == "refused":  # our own throwaway block: the daemon's text is safe to show
        message = f"{message}: {exc}"
    return Check(name, False, message, problem.fix)


def _throwaway(tenant: str) -> tuple[Any, Any]:
    """An identity no engine uses (a fresh weights name each run) and a prompt of 2 blocks."""
    import uuid

    import numpy as np

    from prefixd.schema.identity import Identity

    identity = Identity(
        model="prefixd-doctor",
        weights=f"doctor-{uuid.uuid4().hex[:16]}",
        tokenizer="prefixd-doctor",
        template="none",
        rope="none",
        kv_layout="bytes",
        block_tokens=BLOCK_TOKENS,
        tenant=tenant,
    )
    return identity, np.arange(2 * BLOCK_TOKENS, dtype=np.uint32)


# --- running as another user ---------------------------------------------------------------------


def _account(user: str | None) -> Account:
    """`user` (a name or uid) as an account, or this process's own when None."""
    import pwd

    from prefixd.trust import user_name

    if user is None:
        return Account(user_name(os.geteuid()), os.geteuid(), os.getegid(), tuple(os.getgroups()))
    try:
        entry = pwd.getpwuid(int(user)) if user.strip().isdigit() else pwd.getpwnam(user)
    except KeyError:
        if user.strip().isdigit():  # a uid with no account: its own group only
            uid = int(user)
            return Account(str(uid), uid, uid, (uid,))
        raise ConfigError(f"--as-user: no user {user!r} on this machine") from None
    groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, groups)


def _as(account: Account, checks: Callable[[], list[Check]]) -> list[Check]:
    """`checks()` in a forked child with `account`'s uid, gid and groups; the results come back
    as JSON. Forked, not executed anew: what the checks import is loaded already, so a Python
    installed where the user may not read still runs them."""
    import importlib

    for module in PRELOADED:  # before becoming a user who may not read them
        importlib.import_module(module)
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: become the user, check, report, exit without any cleanup
        code = 0
        try:
            os.close(read)
            os.setgroups(list(account.groups))
            os.setresgid(account.gid, account.gid, account.gid)
            os.setresuid(account.uid, account.uid, account.uid)
            outcome: Any = [asdict(c) for c in checks()]
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
            code = 1
        with os.fdopen(write, "w") as sent:
            json.dump(outcome, sent)
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as received:
        data = received.read()
    os.waitpid(pid, 0)
    outcome = json.loads(data) if data else {"error": "the checking process died"}
    if isinstance(outcome, dict):
        raise ConfigError(f"--as-user {account.name}: {outcome['error']}")
    return [Check(**c) for c in outcome]


# --- output ------------------------------------------------------------------------------------


def _print(report: dict[str, Any], out: Output) -> None:
    lines = [f"prefixd doctor: {report['socket']}, as {report['user']} (uid {report['uid']})"]
    for check in report["checks"]:
        mark = {True: "ok  ", False: "FAIL", None: "skip"}[check["ok"]]
        lines.append(f"  {mark}  {check['name']:<10}  {check['detail']}")
        if check["fix"]:
            lines.append(f"        {'':<10}  fix: {check['fix']}")
    lines.append("every check passed" if report["ok"] else "a check failed")
    out.stdout.write("\n".join(lines) + "\n")
    out.stdout.flush()


def _described(path: Path) -> str:
    import stat

    from prefixd.trust import group_name, user_name

    info = os.lstat(path)
    owner = f"{user_name(info.st_uid)}:{group_name(info.st_gid)}"
    return f"{stat.filemode(info.st_mode)} {owner}"


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _human(size: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if size >= 1 << shift:
            return f"{size / (1 << shift):g} {unit}"
    return f"{size} bytes"


def _timed(times: dict[str, float], key: str, call: Callable[[], T]) -> T:
    """`call()`, its time in milliseconds kept as `times[key]`."""
    import time

    started = time.perf_counter()
    result = call()
    times[key] = round((time.perf_counter() - started) * 1000, 3)
    return result


__all__ = ["CHECKS", "Check", "add_parser", "run", "run_checks"]
