"""Where Config's values come from: flags, PREFIXD_* variables and a TOML file, each parsed the way
its source writes values, and agreed into one Config (see prefixd.daemon.config for the rules).
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from prefixd.daemon.config import (
    CONFIG_ENV,
    ENV_PREFIX,
    META,
    SETTINGS,
    Config,
    cli_flag,
    env_var,
    format_size,
    plain,
    validated,
)
from prefixd.errors import ConfigError
from prefixd.paths import default_data_dir, default_socket
from prefixd.store.config import parse_seconds, parse_size

# Kinds of setting: how a string (flag, environment) is parsed and which TOML types are accepted.
_TEXT_IN_TOML = frozenset({"path", "size", "mode", "seconds", "choice"})
_EXPECTED = {
    "path": "a non-empty path",
    "int": "an integer",
    "size": "a size like 16MiB or a number of bytes (units: B, KiB, MiB, GiB, TiB)",
    "mode": "an octal mode like 0660",
    "float": "a number",
    "seconds": "a duration like 2.5, 10s, 500ms, 5m or 1h",
    "bool": "a boolean (true/false, 1/0, yes/no)",
    "choice": "a string",
    "text": "a string",
    "ids": "a comma-separated list of integers like 1000,1001",
    "entries": "a comma-separated list of NAME=VALUE entries",
}
_TOML_EXPECTED = {
    "path": "a string",
    "int": "an integer",
    "size": "an integer or a string like '16MiB'",
    "mode": "an integer like 0o660 or a string like '0660'",
    "float": "a number",
    "seconds": "a number of seconds or a string like '10s'",
    "bool": "true or false",
    "choice": "a string",
    "text": "a string",
    "ids": "an array of integers",
    "entries": "an array of strings like 'NAME=VALUE'",
}
_METAVARS = {
    "path": "PATH",
    "int": "N",
    "size": "BYTES",
    "mode": "MODE",
    "float": "X",
    "seconds": "SECONDS",
    "bool": "BOOL",
    "text": "TEXT",
    "ids": "ID[,ID...]",
    "entries": "NAME=VALUE[,...]",
}

# --- assembling a Config from its sources ----------------------------------------------------


@dataclass(frozen=True)
class _Given:
    """One source's value of one setting, kept with where it came from for error messages."""

    source: str
    raw: Any
    value: Any


def config_from_sources(
    cli: Mapping[str, Any], env: Mapping[str, str], config_file: Path | None
) -> Config:
    """The Config that flags, environment and TOML file describe together.

    cli: {field_name: raw value} of the flags given (None means not given); strings are parsed like
    environment values, other values are taken as typed. env: the whole environment; PREFIXD_* are
    settings, STATE_DIRECTORY, RUNTIME_DIRECTORY, XDG_* and HOME only feed defaults. config_file:
    the --config value, or None to use PREFIXD_CONFIG if set. Raises ConfigError.
    """
    return config_and_given(cli, env, config_file)[0]


def config_and_given(
    cli: Mapping[str, Any], env: Mapping[str, str], config_file: Path | None
) -> tuple[Config, frozenset[str]]:
    """`config_from_sources`, and the names of the settings some source gave (the others hold
    their defaults): a command told only a data directory looks for the socket that serves it."""
    cwd = Path.cwd()
    given: dict[str, list[_Given]] = {}
    unknown_cli = sorted(set(cli) - set(SETTINGS))
    if unknown_cli:
        raise ConfigError(f"command line: unknown setting(s) {', '.join(unknown_cli)}")
    for name, raw in cli.items():
        if raw is not None:
            given.setdefault(name, []).append(
                _convert(name, raw, cli_flag(name), text=isinstance(raw, str), base=cwd)
            )
    for name, raw in _env_settings(env).items():
        given.setdefault(name, []).append(_convert(name, raw, env_var(name), text=True, base=cwd))
    path = _config_path(config_file, env, cwd)
    if path is not None:
        for name, raw in _file_settings(path).items():
            source = f"{name} in {path}"
            given.setdefault(name, []).append(
                _convert(name, raw, source, text=False, base=path.parent)
            )
    values = {name: _agreed(name, items) for name, items in given.items()}
    instance = values.get("instance", "")
    for name, default in (("data_dir", default_data_dir), ("socket", default_socket)):
        if name not in values:
            values[name] = _attributed(name, default(env, instance), "the default")
    return Config(**values), frozenset(given)


def config_from_args(namespace: argparse.Namespace, env: Mapping[str, str]) -> Config:
    """Glue for the CLI: the flags `add_arguments` put in namespace, plus env and --config."""
    cli = {name: getattr(namespace, name) for name in SETTINGS if hasattr(namespace, name)}
    return config_from_sources(cli, env, getattr(namespace, "config", None))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --config and one --field-name flag per Config field; flags not given stay unset."""
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"TOML file of settings, as top-level keys named like the flags with _ [{CONFIG_ENV}]",
    )
    group = parser.add_argument_group(
        "settings",
        f"each also settable as {ENV_PREFIX}<NAME> or in the --config file; "
        "a setting given twice must have the same value",
    )
    for f in fields(Config):
        kind = f.metadata["kind"]
        choices = f.metadata["choices"]
        has_default = f.default is not MISSING
        shown = f" (default {_shown_default(f.name, f.default)})" if has_default else ""
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if kind == "bool" else {}
        group.add_argument(
            cli_flag(f.name),
            dest=f.name,
            default=argparse.SUPPRESS,
            metavar="{" + ",".join(choices) + "}" if choices else _METAVARS[kind],
            help=f"{f.metadata['help']}{shown} [{env_var(f.name)}]".replace("%", "%%"),
            **extra,
        )


def _config_path(config_file: Path | None, env: Mapping[str, str], cwd: Path) -> Path | None:
    """The TOML file named by --config or PREFIXD_CONFIG (which must agree if both are set)."""
    from_env = env.get(CONFIG_ENV) or None
    candidates = [(str(config_file), "--config")] if config_file is not None else []
    if from_env is not None:
        candidates.append((from_env, CONFIG_ENV))
    if not candidates:
        return None
    paths = [cwd / Path(text).expanduser() for text, _ in candidates]
    if len(set(paths)) > 1:
        (first, first_source), (second, second_source) = candidates
        raise ConfigError(
            f"config: set to {first} by {first_source} and to {second} by {second_source}"
        )
    return paths[0]


def _env_settings(env: Mapping[str, str]) -> dict[str, str]:
    """The PREFIXD_* variables as {setting: raw text}; any that names no setting is an error."""
    known = {env_var(name): name for name in SETTINGS}
    ours = [key for key in env if key.startswith(ENV_PREFIX) and key != CONFIG_ENV]
    unknown = sorted(key for key in ours if key not in known)
    if unknown:
        names = ", ".join(_with_hint(key, key.removeprefix(ENV_PREFIX).lower()) for key in unknown)
        raise ConfigError(
            f"environment: unknown variable(s) {names}; every {ENV_PREFIX}* variable must name a "
            "setting"
        )
    return {known[key]: env[key] for key in ours}


def _file_settings(path: Path) -> dict[str, Any]:
    """The settings a TOML file holds; keys that name no setting are an error."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from None
    cluster = data.pop("cluster", None)
    if isinstance(cluster, dict):  # [cluster] master = ... is cluster_master
        for key, value in cluster.items():
            data[f"cluster_{key}"] = value
    elif cluster is not None:
        raise ConfigError(f"config: cluster in {path} must be a table ([cluster])")
    unknown = sorted(set(data) - set(SETTINGS))
    if unknown:
        names = ", ".join(_with_hint(key, key) for key in unknown)
        raise ConfigError(
            f"config: unknown setting(s) in {path}: {names}; settings are top-level keys "
            "named like the fields (see prefixd serve --print-config)"
        )
    return data


def _with_hint(shown: str, probe: str) -> str:
    """An unknown name as its source spells it, plus the setting it probably meant."""
    close = difflib.get_close_matches(probe, SETTINGS, n=1)
    if not close:
        return shown
    suggestion = env_var(close[0]) if shown.startswith(ENV_PREFIX) else close[0]
    return f"{shown} (did you mean {suggestion}?)"


def _convert(name: str, raw: Any, source: str, *, text: bool, base: Path) -> _Given:
    """Parse and validate one source's raw value; errors name the setting and the source."""
    kind = META[name]["kind"]
    if META[name]["optional"] and raw in ("", None):
        return _Given(source, raw, None)  # an optional path given empty: off
    if isinstance(raw, str) and (text or kind in _TEXT_IN_TOML):
        try:
            value = _PARSERS[kind](raw)
        except ValueError:
            raise ConfigError(f"{name}: {raw!r} from {source} is not {_EXPECTED[kind]}") from None
    elif _native_ok(kind, raw):
        value = raw
    else:
        raise ConfigError(
            f"{name}: {source} must be {_TOML_EXPECTED[kind]}, got {_toml_type(raw)} {raw!r}"
        )
    if kind == "path" and value is not None:
        value = base / Path(value).expanduser()
    return _Given(source, raw, _attributed(name, value, source))


def _attributed(name: str, value: Any, source: str) -> Any:
    try:
        return validated(name, value)
    except ConfigError as exc:
        raise ConfigError(f"{exc} (set by {source})") from None


def _agreed(name: str, items: list[_Given]) -> Any:
    """The one value all sources gave a setting; different values are an error naming them all."""
    if all(item.value == items[0].value for item in items[1:]):
        return items[0].value
    parts = [f"{_shown(name, item)} by {item.source}" for item in items]
    listed = ", to ".join(parts[:-1]) + " and to " + parts[-1]
    raise ConfigError(f"{name}: set to {listed}")


def _shown(name: str, item: _Given) -> str:
    """A value as its source wrote it, plus what it means where that differs (16MiB, ./data)."""
    raw = item.raw if isinstance(item.raw, str) else _toml_text(item.raw)
    effective = _text(plain(name, item.value))
    return raw if raw == effective else f"{raw} (= {effective})"


def _shown_default(name: str, default: Any) -> str:
    kind = META[name]["kind"]
    if kind == "size":
        return format_size(default)
    if kind == "ids":
        return ",".join(map(str, default)) or "none"
    return _text(plain(name, default))


# --- parsing text ------------------------------------------------------------------------------

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
    if not text.strip():
        return ()
    return tuple(int(part) for part in text.split(","))


_PARSERS: dict[str, Callable[[str], Any]] = {
    "path": _parse_path,
    "int": int,
    "size": parse_size,
    "mode": lambda text: int(text, 8),
    "float": float,
    "seconds": parse_seconds,
    "bool": _parse_bool,
    "choice": lambda text: text,
    "text": lambda text: text,
    "ids": _parse_ids,
    "entries": lambda text: tuple(item.strip() for item in text.split(",") if item.strip()),
}


def _native_ok(kind: str, value: Any) -> bool:
    """Whether a typed value (from TOML, or a typed cli mapping) has the Python type kind needs."""
    if kind == "path":
        return isinstance(value, os.PathLike)
    if kind in ("int", "size", "mode"):
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in ("float", "seconds"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind in ("choice", "text"):
        return isinstance(value, str)
    if kind == "entries":
        return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    )


def _toml_type(value: Any) -> str:
    names = {bool: "boolean", int: "integer", float: "float", str: "string", list: "array"}
    return "table" if isinstance(value, dict) else names.get(type(value), type(value).__name__)


def _toml_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    return str(value)


def _text(value: Any) -> str:
    """A plain value for a message: strings unquoted, everything else as TOML writes it."""
    return value if isinstance(value, str) else _toml_text(value)


