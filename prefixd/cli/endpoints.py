"""Which store and which daemon a command means, from the same Config `serve` reads.

Flags, PREFIXD_* variables and the `--config` TOML file give `data_dir` and `socket` exactly as they
do to `serve`. The two are then kept together, so they can never name different stores: a store
that a daemon holds records the socket it serves on (its owner lock), and a daemon tells the store
it serves (`health`). A command told only one of them finds the other; told both, it refuses a
pair that does not belong together.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prefixd.daemon.config import Config
from prefixd.daemon.config_sources import config_and_given
from prefixd.errors import ConfigError, DaemonUnavailableError
from prefixd.store.environment import held_socket


@dataclass(frozen=True)
class Target:
    """The store a command works on, and the socket of the daemon that serves it (if any)."""

    config: Config
    data_dir: Path
    socket: Path
    served: bool  # a daemon holds the store (online commands go through it)


def target(args: argparse.Namespace, env: Mapping[str, str], *, timeout: float) -> Target:
    """The Target of a command's --data-dir, --socket and --config (and PREFIXD_*)."""
    cli = {name: getattr(args, name, None) for name in ("data_dir", "socket")}
    config, given = config_and_given(cli, env, getattr(args, "config", None))
    data_dir, socket = config.data_dir, config.socket
    recorded = held_socket(data_dir)
    if recorded is not None and recorded != socket:
        if "socket" in given:
            raise ConfigError(
                f"socket: the store {data_dir} is served on {recorded}, not on {socket}"
            )
        socket = recorded
    if recorded is None and "data_dir" not in given:
        served_dir = _served_dir(socket, timeout)
        if served_dir is not None:
            data_dir = served_dir
            recorded = held_socket(data_dir)
    elif recorded is None and "socket" in given:
        served_dir = _served_dir(socket, timeout)
        if served_dir is not None and served_dir != data_dir:
            raise ConfigError(
                f"data_dir: the daemon on {socket} serves {served_dir}, not {data_dir}"
            )
    return Target(config, data_dir, socket, served=recorded is not None)


def _served_dir(socket: Path, timeout: float) -> Path | None:
    """The store the daemon on `socket` serves, or None when none answers there."""
    if not socket.exists():
        return None
    from prefixd.client import Client

    try:
        with Client(socket, timeout=timeout) as client:
            reply = client.health()
    except DaemonUnavailableError:
        return None
    served = reply.get("data_dir")
    return Path(served) if served else None
