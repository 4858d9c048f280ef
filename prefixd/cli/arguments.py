"""Flags the commands share: which store and daemon (and the settings they give), and positive
quantities refused at the command line with their unit named."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from prefixd.config.settings import Config

T = TypeVar("T", int, float)

# The settings that say which store and daemon a command means: its paths, the instance (its
# default paths) and the daemon's user (whom the client trusts).
DAEMON_SETTINGS = ("data_dir", "socket", "instance", "daemon_user")


def add_daemon_arguments(where: Any, *, data_dir: bool) -> None:
    """The flags that say which store and daemon a command means, as `serve` has them."""
    from prefixd.config.sources import add_config_flag, add_setting_flags

    add_config_flag(where)
    add_setting_flags(where, DAEMON_SETTINGS if data_dir else DAEMON_SETTINGS[1:])


def daemon_config(
    args: argparse.Namespace, env: Mapping[str, str]
) -> tuple[Config, frozenset[str]]:
    """The Config that the flags of `add_daemon_arguments`, PREFIXD_* and --config give, and the
    names of the settings some source gave (`config_and_given`)."""
    from prefixd.config.sources import config_and_given

    cli = {name: getattr(args, name, None) for name in DAEMON_SETTINGS}
    return config_and_given(cli, env, getattr(args, "config", None))


def positive(parse: Callable[[str], T], what: str, unit: str) -> Callable[[str], T]:
    """An argparse type: `parse(text)`, refused unless it is more than 0 `unit`."""

    def convert(text: str) -> T:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 {unit}")
        return value

    return convert
