"""Where a node's stores and sockets live unless told. Under systemd: StateDirectory= and
RuntimeDirectory=; else root's daemon uses the FHS places (/var/lib/prefixd, /run/prefixd) and
other users the XDG ones, but for the service user of the shipped units, whose store is the
node's (/var/lib/prefixd) wherever it runs a command. A named instance (prefixd@NAME, one per
GPU or NUMA node) uses prefixd-NAME in the same places, so instances never share a directory.
"""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping
from pathlib import Path

from prefixd.errors import ConfigError

SERVICE_USER = "prefixd"  # the account systemd/prefixd.service runs the daemon as
# no ':': systemd reads StateDirectory=prefixd-%i of prefixd@numa:1 as prefixd-numa plus a link
# named 1, so instances numa:1 and numa:2 would share one store
INSTANCE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_instance(name: str) -> str:
    """`name` when it can name an instance (it becomes part of directory and unit names)."""
    if not INSTANCE_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"instance: {name!r} is not an instance name (letters, digits, '_', '.' and "
            "'-', at most 64, like gpu0 or numa1)"
        )
    return name


def node_socket(instance: str = "") -> Path:
    """The socket the shipped units (prefixd.socket, prefixd@INSTANCE.socket) listen on."""
    return Path("/run") / _instance_dir(instance) / "prefixd.sock"


def default_data_dir(env: Mapping[str, str], instance: str = "") -> Path:
    """Where the store lives unless told: systemd's StateDirectory=, else the FHS or XDG place
    (prefixd-INSTANCE for a named instance)."""
    if env.get("STATE_DIRECTORY"):
        return Path(env["STATE_DIRECTORY"].split(":")[0])  # several StateDirectory= are ':'-joined
    name = _instance_dir(instance)
    if os.geteuid() == 0 or os.geteuid() == service_uid():
        return Path("/var/lib") / name
    return _xdg_dir(env, "XDG_STATE_HOME", ".local/state") / name


def default_socket(env: Mapping[str, str], instance: str = "") -> Path:
    """Where the socket lives unless told: systemd's RuntimeDirectory=, else /run or XDG or /tmp
    (in prefixd-INSTANCE for a named instance)."""
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / "prefixd.sock"
    if os.geteuid() == 0:
        return node_socket(instance)
    name = _instance_dir(instance)
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):  # the XDG spec says to ignore relative values
        return Path(runtime) / name / "prefixd.sock"
    suffix = f"-{instance}" if instance else ""
    return Path(f"/tmp/prefixd-{os.geteuid()}{suffix}/prefixd.sock")


def _instance_dir(instance: str) -> str:
    """The directory name of an instance's store and socket: prefixd, or prefixd-NAME."""
    return f"prefixd-{check_instance(instance)}" if instance else "prefixd"


def service_uid() -> int | None:
    """The uid of the shipped units' account (SERVICE_USER), if this machine has one."""
    return uid_of(SERVICE_USER)


def uid_of(name: str) -> int | None:
    """The uid of the account `name`, if this machine has one."""
    try:
        return pwd.getpwnam(name).pw_uid
    except KeyError:
        return None


def _xdg_dir(env: Mapping[str, str], variable: str, fallback: str) -> Path:
    value = env.get(variable, "")
    if os.path.isabs(value):
        return Path(value)
    return (Path(env["HOME"]) if env.get("HOME") else Path.home()) / fallback


__all__ = [
    "SERVICE_USER",
    "check_instance",
    "default_data_dir",
    "default_socket",
    "node_socket",
    "service_uid",
    "uid_of",
]
