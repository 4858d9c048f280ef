"""Flags the commands share, parsed the same way everywhere: which store and daemon a command
means, and positive quantities (durations, sizes) refused at the command line with the unit named.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T", int, float)


def add_daemon_arguments(where: Any, *, data_dir: bool) -> None:
    """The flags that say which store and daemon a command means, as `serve` reads them (each
    also a PREFIXD_* variable and a TOML key): every command that talks to a daemon has them."""
    where.add_argument("--config", type=Path, metavar="FILE", help="TOML settings [PREFIXD_CONFIG]")
    if data_dir:
        where.add_argument(
            "--data-dir", metavar="PATH", help="the store (default: as serve) [PREFIXD_DATA_DIR]"
        )
    where.add_argument(
        "--socket", metavar="PATH", help="the daemon's socket (default: as serve) [PREFIXD_SOCKET]"
    )
    where.add_argument(
        "--instance",
        metavar="NAME",
        help="which of the node's daemons (prefixd@NAME): its default store and socket "
        "[PREFIXD_INSTANCE]",
    )
    where.add_argument(
        "--daemon-user",
        metavar="USER",
        help="the user the daemon runs as, trusted besides root, you and prefixd "
        "[PREFIXD_DAEMON_USER]",
    )


def positive(parse: Callable[[str], T], what: str, unit: str) -> Callable[[str], T]:
    """An argparse type: `parse(text)`, refused unless it is more than 0 (`what` names what was
    expected, `unit` the unit of the value)."""

    def convert(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 {unit}")
        return value

    return convert
