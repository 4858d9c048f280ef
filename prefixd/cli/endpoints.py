"""Which store and which daemon a command means, from the same Config `serve` reads.

`data_dir` and `socket` are kept together so they never name different stores: a held store
records its socket (its owner lock) and a daemon tells its store (`health`). Told one, a command
finds the other; told both, it refuses a pair that does not match. A socket alone names a store
only through the daemon answering there, never the default store: a typo must not verify, purge
or migrate another store.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prefixd.cli.arguments import daemon_config
from prefixd.config.settings import Config
from prefixd.errors import (
    ConfigError,
    DaemonUnavailableError,
    NotAStoreError,
    UntrustedDaemonError,
)
from prefixd.paths import node_socket
from prefixd.store.environment import DATA_FILE, held_socket, is_held

if TYPE_CHECKING:
    from prefixd.client import Client


@dataclass(frozen=True)
class Target:
    """The store a command works on, and the socket of the daemon that serves it (if any)."""

    config: Config
    data_dir: Path
    socket: Path
    served: bool  # a daemon holds the store (online commands go through it)

    def client(self, timeout: float) -> Client:
        """A connection to the daemon on `socket`, trusting the daemon's user the settings name."""
        from prefixd.client import Client

        return Client(
            self.socket, timeout=timeout, daemon_uid=self.config.socket.daemon_user or None
        )


def target(
    args: argparse.Namespace,
    env: Mapping[str, str],
    *,
    timeout: float,
    offline: bool = True,
    probe: bool = True,
) -> Target:
    """The Target of a command's --data-dir, --socket and --config (and PREFIXD_*). `offline`:
    the command can work on the store itself, so a socket alone where no daemon answers is
    refused; otherwise the socket is taken as told, and the client's error follows. `probe`
    False (commands that only work offline: compact, migrate): a default store that exists and
    nobody holds is theirs without asking the default socket which store its daemon serves, since
    asking a socket unit starts the daemon, which would then hold that store."""
    config, given = daemon_config(args, env)
    data_dir, socket = config.store.data_dir, config.socket.path
    user = config.socket.daemon_user or None
    if not _present(data_dir / DATA_FILE):  # else the user's, whose daemon may be stopped
        socket = node_fallback(config, given)
    if "socket" in given and "data_dir" not in given:  # the socket alone names the store
        try:
            served_dir = _served_dir(socket, timeout, user)
        except UntrustedDaemonError:
            raise
        except DaemonUnavailableError as exc:
            if not offline:  # the client's own error follows, when the command connects
                return Target(config, data_dir, socket, served=False)
            raise DaemonUnavailableError(
                f"{exc}; a socket where no daemon answers names no store: to work on a store "
                "offline, give --data-dir STORE"
            ) from None
        return Target(config, served_dir or data_dir, socket, served=True)
    if offline and data_dir.exists() and not data_dir.is_dir():
        raise NotAStoreError(f"{data_dir} is not a directory: give --data-dir a store's directory")
    recorded = held_socket(data_dir)
    if recorded is not None:
        if "socket" in given and recorded != socket:
            raise ConfigError(
                f"socket: the store {data_dir} is served on {recorded}, not on {socket}"
            )
        try:  # another daemon may have taken the path since: the one there must serve this store
            served_dir = _served_dir(recorded, timeout, user)
        except UntrustedDaemonError:
            raise
        except DaemonUnavailableError:  # not answering: the command's own error follows
            served_dir = None
        if served_dir is not None and not _same_dir(served_dir, data_dir):
            raise ConfigError(
                f"data_dir: the store {data_dir} is held, and the daemon on the socket it "
                f"recorded ({recorded}) serves {served_dir}: stop what holds {data_dir}, or give "
                "--socket of the daemon serving it"
            )
        return Target(config, data_dir, recorded, served=True)
    if "data_dir" in given and "socket" not in given:
        return Target(config, data_dir, socket, served=False)
    if not probe and "socket" not in given and _unheld_store(data_dir):
        return Target(config, data_dir, socket, served=False)
    try:
        served_dir = _served_dir(socket, timeout, user)
    except UntrustedDaemonError:
        raise
    except DaemonUnavailableError:  # no daemon: the store named (or the default) offline
        return Target(config, data_dir, socket, served=False)
    if served_dir is None:  # a daemon that does not say which store it serves
        return Target(config, data_dir, socket, served=False)
    if "data_dir" not in given:  # both defaults: the default socket's daemon names the store
        return Target(config, served_dir, socket, served=True)
    if not _same_dir(served_dir, data_dir):
        raise ConfigError(f"data_dir: the daemon on {socket} serves {served_dir}, not {data_dir}")
    return Target(config, data_dir, socket, served=True)


def node_fallback(config: Config, given: AbstractSet[str]) -> Path:
    """The socket a command that names none means: the user's own default, or the node's daemon's
    (the shipped units') where no daemon of the user's own listens."""
    socket = config.socket.path
    if {"socket", "data_dir"} & given or _present(socket):
        return socket
    node = node_socket(config.store.instance)
    return node if _present(node) else socket


def _same_dir(one: Path, other: Path) -> bool:
    """Whether two paths name one directory (a symbolic link to it, a relative path)."""
    try:
        return one.resolve() == other.resolve()
    except OSError:
        return one == other


def _unheld_store(data_dir: Path) -> bool:
    """A store lies in `data_dir` and no process holds it (False when this user may not tell)."""
    try:
        return (data_dir / DATA_FILE).exists() and not is_held(data_dir)
    except OSError:
        return False


def _present(path: Path) -> bool:
    """Something lies at `path`, or this user may not look (the client then says why)."""
    try:
        return path.exists()
    except PermissionError:
        return True


def _served_dir(socket: Path, timeout: float, daemon_user: str | None) -> Path | None:
    """The store the daemon on `socket` serves (None when it does not say); the client's error
    when none answers there, or one that is not to be trusted."""
    from prefixd.client import Client

    with Client(socket, timeout=timeout, daemon_uid=daemon_user) as client:
        reply = client.health()
    served = reply.get("data_dir")
    return Path(served) if served else None
