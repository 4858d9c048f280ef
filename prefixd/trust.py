"""Which paths and peers prefixd trusts: the daemon's directories, and the daemon a client talks to.

Another local user must not be able to stand in for the daemon. A socket directory that user owns
or may write lets them replace the socket with their own and receive a client's identity, token
ids and payloads; a data directory they may write lets them replace the store. So the daemon
serves only from directories owned by its own user (or root) that no one else may write, and a
client, before it sends anything, checks that the socket and its directory belong to the user it
expects the daemon to run as (its own, or root, unless told another) and, once connected, that
the process on the other end runs as that user (SO_PEERCRED).
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from collections.abc import Collection
from pathlib import Path

from prefixd.errors import UntrustedDaemonError, UntrustedPathError

_UCRED = struct.Struct("3i")  # pid, uid, gid


def daemon_uids(expected: int | None = None) -> frozenset[int]:
    """The users a client accepts as the daemon's: `expected` when given, else its own or root."""
    return frozenset({expected} if expected is not None else {os.geteuid(), 0})


def check_private_dir(path: Path, what: str) -> None:
    """Refuse a directory this process's user does not own (root may), that is a symbolic link,
    or that another user may write (group or others): the daemon's socket and data directories."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise UntrustedPathError(f"{what} {path} does not exist") from None
    if stat.S_ISLNK(info.st_mode):
        raise UntrustedPathError(f"{what} {path} is a symbolic link: give the real directory")
    if not stat.S_ISDIR(info.st_mode):
        raise UntrustedPathError(f"{what} {path} is not a directory")
    if info.st_uid not in (os.geteuid(), 0):
        raise UntrustedPathError(
            f"{what} {path} belongs to uid {info.st_uid}, not to this daemon's uid {os.geteuid()}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedPathError(
            f"{what} {path} may be written by other users (mode {stat.filemode(info.st_mode)}): "
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
    if not stat.S_ISSOCK(sock_info.st_mode):
        raise UntrustedDaemonError(f"{path} is not a socket")
    if sock_info.st_uid not in uids:
        raise UntrustedDaemonError(
            f"the socket {path} belongs to uid {sock_info.st_uid}, not to the daemon's "
            f"({_names(uids)}): not sending anything"
        )
    if dir_info.st_uid not in uids:
        raise UntrustedDaemonError(
            f"the socket's directory {path.parent} belongs to uid {dir_info.st_uid}, not to the "
            f"daemon's ({_names(uids)}): not sending anything"
        )
    writable = dir_info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not dir_info.st_mode & stat.S_ISVTX:
        raise UntrustedDaemonError(
            f"the socket's directory {path.parent} may be written by other users, who could "
            "replace the socket: not sending anything"
        )


def check_peer(sock: socket.socket, uids: Collection[int]) -> None:
    """After connecting: the process on the other end runs as one of `uids`."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    _pid, uid, _gid = _UCRED.unpack(raw)
    if uid not in uids:
        raise UntrustedDaemonError(
            f"the process serving the socket runs as uid {uid}, not as the daemon's "
            f"({_names(uids)}): not sending anything"
        )


def _names(uids: Collection[int]) -> str:
    return "uid " + " or ".join(str(u) for u in sorted(uids))


__all__ = ["check_peer", "check_private_dir", "check_socket_path", "daemon_uids"]
