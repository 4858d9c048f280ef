"""Flags the commands share: which store and daemon, and positive quantities refused at the
command line with their unit named."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T", int, float)


def add_daemon_arguments(where: Any, *, data_dir: bool) -> None:
    """The flags that say which store and daemon a command means, as `serve` has them."""
    from prefixd.config.sources import add_config_flag, add_setting_flags

    add_config_flag(where)
    add_setting_flags(where, ("data_dir",) * data_dir + ("socket", "instance", "daemon_user"))


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
