"""The kinds of setting (a size, a duration, a path, a list of ids, ...): how each is parsed
from the text of a flag or variable, which typed values (TOML's, Python's) it takes, and how it
holds them."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixd.errors import ConfigError
from prefixd.store.config import format_size, parse_seconds, parse_size

MAX_ID = (1 << 32) - 2  # uid_t/gid_t; 2**32 - 1 is (uid_t)-1, which means "no id"


def typed(name: str, value: Any, meta: Mapping[str, Any]) -> Any:
    """`value` held as its kind holds it, or ConfigError "<name>: <problem>": its type, choices
    and range as `meta` (a setting's field metadata) declares them."""
    kind = KINDS[meta["kind"]]
    if not kind.accepts(value):
        raise ConfigError(f"{name}: must be {kind.typed}, got {type_name(value)} {value!r}")
    value = kind.held(value)
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{name}: must be one of {', '.join(meta['choices'])}, got {value!r}")
    if meta["kind"] == "text" and (len(value) > 4096 or "\n" in value):
        raise ConfigError(f"{name}: must be one line of text, got {value!r}")
    low, high = (0, MAX_ID) if meta["kind"] == "ids" else (meta["low"], meta["high"])
    for item in value if meta["kind"] == "ids" else () if low is None else (value,):
        if not low <= item <= high:
            show = _SHOWN.get(meta["kind"], str)
            raise ConfigError(f"{name}: must be in [{show(low)}, {show(high)}], got {show(item)}")
    return value


_SHOWN: dict[str, Callable[[Any], str]] = {"size": format_size, "mode": lambda n: f"{n:#o}"}


def type_name(value: Any) -> str:
    """A value's type as TOML names it, for messages."""
    names = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array"}
    return "table" if isinstance(value, dict) else names.get(type(value), type(value).__name__)


# --- the kinds of setting ---------------------------------------------------------------------

_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _parse_path(text: str) -> Path:
    if not text:
        raise ValueError(text)
    return Path(text)


def _parse_bool(text: str) -> bool:
    try:
        return _BOOLS[text.strip().lower()]
    except KeyError:
        raise ValueError(text) from None


def _parse_ids(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(",")) if text.strip() else ()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _list_of(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, (list, tuple)) and all(map(check, value))


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _same(value: Any) -> Any:
    return value


def _names(value: Any) -> frozenset[str]:
    items = (value,) if isinstance(value, str) else value
    return frozenset(n.strip() for item in items for n in item.split(",") if n.strip())


@dataclass(frozen=True)
class Kind:
    """How a kind of setting is written: its flag's metavar, how text (a flag, a variable; and a
    TOML string where `text_in_toml`) parses, the typed values it takes (from TOML or Python)
    and holds, and what the messages say each must be."""

    metavar: str
    parse: Callable[[str], Any]
    accepts: Callable[[Any], bool]
    expected: str  # of text
    typed: str  # of a typed value
    text_in_toml: bool = False
    held: Callable[[Any], Any] = _same


KINDS = {
    "path": Kind(
        "PATH",
        _parse_path,
        lambda v: isinstance(v, (str, os.PathLike)) and bool(str(v)),
        "a non-empty path",
        "a path",
        True,
        Path,
    ),
    "int": Kind("N", int, _is_int, "an integer", "an integer"),
    "size": Kind(
        "BYTES",
        parse_size,
        _is_int,
        "a size like 16MiB or a number of bytes (units: B, KiB, MiB, GiB, TiB)",
        "an integer or a string like '16MiB'",
        True,
    ),
    "mode": Kind(
        "MODE",
        lambda text: int(text, 8),
        _is_int,
        "an octal mode like 0660",
        "an integer like 0o660 or a string like '0660'",
        True,
    ),
    "float": Kind("X", float, _is_number, "a number", "a number", held=float),
    "seconds": Kind(
        "SECONDS",
        parse_seconds,
        _is_number,
        "a duration like 2.5, 10s, 500ms, 5m or 1h",
        "a number of seconds or a string like '10s'",
        True,
        float,
    ),
    "bool": Kind(
        "BOOL",
        _parse_bool,
        lambda v: isinstance(v, bool),
        "a boolean (true/false, 1/0, yes/no)",
        "true or false",
    ),
    "choice": Kind("", _same, _is_str, "a string", "a string", True),
    "text": Kind("TEXT", _same, _is_str, "a string", "a string"),
    "names": Kind(
        "NAME[,NAME...]",
        _same,
        lambda v: _is_str(v) or _list_of(_is_str)(v) or isinstance(v, frozenset),
        "comma-separated names",
        "a string of comma-separated names or an array of strings",
        held=_names,
    ),
    "ids": Kind(
        "ID[,ID...]",
        _parse_ids,
        _list_of(_is_int),
        "a comma-separated list of integers like 1000,1001",
        "an array of integers",
        held=tuple,
    ),
    "entries": Kind(
        "NAME=VALUE[,...]",
        lambda text: tuple(item.strip() for item in text.split(",") if item.strip()),
        _list_of(_is_str),
        "a comma-separated list of NAME=VALUE entries",
        "an array of strings like 'NAME=VALUE'",
        held=tuple,
    ),
}
