"""Which paths and peers prefixd trusts: the daemon's directories, and the daemon a client talks to.

Another local user must not stand in for the daemon: one who may write the socket's directory
could swap in their own socket and receive a client's identity, tokens and payloads; one who may
write the data directory could replace the store. So the daemon serves only from directories
owned by its user (or root) that no one else may write, and a client checks, before it sends
anything, that the socket, its directory and the process serving it (SO_PEERCRED) belong to a
user it trusts: root and the daemon's user when named (`PREFIXD_DAEMON_USER`, `daemon_uid=`),
else also its own user and the shipped units' `prefixd` service user. Only root can make an
account or chown a file to one, so another ordinary user's socket still fails.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import stat
import struct
from collections.abc import Collection, Mapping
from pathlib import Path

from prefixd.errors import (
    ConfigError,
    DaemonUnavailableError,
    UntrustedDaemonError,
    UntrustedPathError,
)
from prefixd.paths import service_uid, uid_of

_UCRED = struct.Struct("3i")  # pid, uid, gid

DAEMON_USER_VARIABLE = "PREFIXD_DAEMON_USER"


def daemon_uids(
    expected: int | str | None = None, env: Mapping[str, str] | None = None
) -> frozenset[int]:
    """The users a client accepts as the daemon's (see the module docstring)."""
    named = (
        expected
        if expected is not None
        else (os.environ if env is None else env).get(DAEMON_USER_VARIABLE)
    )
    if named is not None and named != "":
        try:
            return frozenset({resolve_user(named), 0})
        except ConfigError as exc:
            what = "daemon_uid" if expected is not None else DAEMON_USER_VARIABLE
            raise ConfigError(f"{what}: {exc}") from None
    uids = {os.geteuid(), 0}
    service = service_uid()
    if service is not None:
        uids.add(service)
    return frozenset(uids)


def resolve_user(user: int | str) -> int:
    """The uid of a user given by name or number (a number that names no account is kept: a
    daemon may run under a uid without a passwd entry)."""
    if isinstance(user, int):
        return user
    text = user.strip()
    if text.isdigit():
        return int(text)
    uid = uid_of(text)
    if uid is None:
        raise ConfigError(f"no user {text!r} on this machine (give a user name or uid)")
    return uid


def check_private_dir(path: Path, what: str, files: Collection[str] = ()) -> None:
    """Refuse a directory this process's user does not own (root may), that is a symbolic link,
    or that another user may write (group or others); one another user could move away and
    replace (a directory above it they own, or may write without the sticky bit); and any of
    `files` in it that is not a plain file of the same kind (a store's own files, which another
    user could otherwise rewrite, checksums and all): the daemon's socket and data directories."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise UntrustedPathError(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedPathError(f"{what} {path} is a symbolic link: give the real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedPathError(f"{what} {path} is not a directory")
    _check_private(path, info.st_uid, info.st_mode, what)
    for above in Path(os.path.realpath(path)).parents:
        info = os.stat(above)
        # sticky (/tmp): others may write there, but not move what is not theirs
        mode = info.st_mode & ~0o022 if info.st_mode & stat.S_ISVTX else info.st_mode
        _check_private(above, info.st_uid, mode, f"{what} {path}: the directory above it,")
    for name in files:
        try:
            info = os.lstat(path / name)
        except FileNotFoundError:
            continue
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedPathError(f"{what} {path}: {name} is not a plain file")
        _check_private(path / name, info.st_uid, info.st_mode, what)


def _check_private(path: Path, uid: int, mode: int, what: str) -> None:
    if uid not in (os.geteuid(), 0):
        raise UntrustedPathError(
            f"{what} {path} belongs to uid {uid}, not to this daemon's uid {os.geteuid()}"
        )
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedPathError(
            f"{what} {path} may be written by other users (mode {stat.filemode(mode)}): "
            "make it writable by its owner only"
        )


def check_socket_path(path: Path, uids: Collection[int]) -> None:
    """Before connecting: the socket and its directory belong to one of `uids`, and no one else
    may replace the socket (its directory is not writable by others, unless sticky)."""
    try:
        sock_info = os.lstat(path)
        dir_info = os.stat(path.parent)
    except FileNotFoundError:
        return  # nothing there: the connect reports it
    except PermissionError as exc:
        raise unreachable(path, exc) from None
    if not stat.S_ISSOCK(sock_info.st_mode):
        raise UntrustedDaemonError(f"{path} is not a socket")
    if sock_info.st_uid not in uids:
        raise UntrustedDaemonError(
            f"the socket {path} belongs to {_who(sock_info.st_uid)}, not to a user trusted to "
            f"run the daemon ({_names(uids)}): not sending anything. {_fix(sock_info.st_uid)}"
        )
    if dir_info.st_uid not in uids:
        raise UntrustedDaemonError(
            f"the socket's directory {path.parent} belongs to {_who(dir_info.st_uid)}, not to a "
            f"user trusted to run the daemon ({_names(uids)}): not sending anything. "
            f"{_fix(dir_info.st_uid)}"
        )
    writable = dir_info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not dir_info.st_mode & stat.S_ISVTX:
        raise UntrustedDaemonError(
            f"the socket's directory {path.parent} may be written by other users, who could "
            "replace the socket: not sending anything"
        )


def check_peer(sock: socket.socket, uids: Collection[int]) -> tuple[int, int, int]:
    """After connecting: the peer process runs as one of `uids`; its (pid, uid, gid)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    if uid not in uids:
        raise UntrustedDaemonError(
            f"the process serving the socket runs as {_who(uid)}, not as a user trusted to run "
            f"the daemon ({_names(uids)}): not sending anything. {_fix(uid)}"
        )
    return pid, uid, gid


def unreachable(path: Path, exc: OSError) -> DaemonUnavailableError:
    """The error for a socket this process cannot connect to, saying what to do about it."""
    if isinstance(exc, PermissionError):
        denied = access_problem(path)
        what, fix = denied or (f"permission denied on {path}", DENIED_FIX)
        return DaemonUnavailableError(f"cannot connect to {path}: {what}. {fix}")
    if isinstance(exc, FileNotFoundError):
        return DaemonUnavailableError(
            f"cannot connect to {path}: no socket there. Start the daemon (systemctl start "
            "prefixd.socket, or prefixd@NAME.socket for an instance), or name the socket it "
            "serves on"
        )
    if isinstance(exc, ConnectionRefusedError):
        return DaemonUnavailableError(
            f"cannot connect to {path}: nothing listens there (a stopped daemon's socket). Start "
            "the daemon (systemctl start prefixd.socket)"
        )
    return DaemonUnavailableError(f"cannot connect to {path}: {exc}")


DENIED_FIX = (
    "add the engine's user to the group that owns the socket and its directory (prefixd under "
    "the shipped units)"
)


def access_problem(path: Path) -> tuple[str, str] | None:
    """(what, fix) when this process's user may not enter one of the directories above the
    socket `path` or may not write (connect to) the socket itself; None when it may."""
    user = user_name(os.geteuid())
    for directory in [*reversed(path.parents), path]:
        try:
            info = os.stat(directory)
        except OSError:  # not there (nothing to be denied), or not passable: said above
            return None
        if directory == path:
            if not os.access(path, os.W_OK):
                return _access_fix(path, info, stat.S_IWGRP, "connect to the socket", user)
        elif not os.access(directory, os.X_OK):
            return _access_fix(directory, info, stat.S_IXGRP, "enter the directory", user)
    return None


def _access_fix(
    path: Path, info: os.stat_result, group_bit: int, verb: str, user: str
) -> tuple[str, str]:
    group = group_name(info.st_gid)
    what = (
        f"{user} may not {verb} {path} ({stat.filemode(info.st_mode)}, "
        f"owner {user_name(info.st_uid)}, group {group})"
    )
    if info.st_mode & group_bit and info.st_gid != 0:
        return what, (
            f"add {user} to group {group} (usermod -aG {group} {user}), then restart the engine"
        )
    return what, (
        f"{path} lets no group of {user} in: run the daemon as the shipped units do (socket "
        f"0660 in a 0750 directory, group prefixd) and add {user} to that group "
        f"(usermod -aG prefixd {user})"
    )


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def _who(uid: int) -> str:
    """`uid 999 (prefixd)`: the number, and the name when the account has one."""
    name = user_name(uid)
    return f"uid {uid}" if name == str(uid) else f"uid {uid} ({name})"


def _names(uids: Collection[int]) -> str:
    return " or ".join(_who(u) for u in sorted(uids))


def _fix(uid: int) -> str:
    user = user_name(uid)
    return (
        f"If the daemon does run as {user}, say so: {DAEMON_USER_VARIABLE}={user} (or "
        f"--daemon-user {user}, daemon_uid={user!r})"
    )


__all__ = [
    "DAEMON_USER_VARIABLE",
    "DENIED_FIX",
    "access_problem",
    "check_peer",
    "check_private_dir",
    "check_socket_path",
    "daemon_uids",
    "group_name",
    "resolve_user",
    "unreachable",
    "user_name",
]
