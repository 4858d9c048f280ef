"""Where Config's values come from: flags, PREFIXD_* variables and a TOML file, each parsed the way
its source writes values, and agreed into one Config (see prefixd.config.settings for the rules).
"""

from __future__ import annotations

import argparse
import difflib
import logging
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from prefixd.config.kinds import KINDS, type_name
from prefixd.config.settings import (
    CONFIG_ENV,
    DEFAULTS,
    DEPRECATED,
    ENV_PREFIX,
    META,
    SETTINGS,
    TABLES,
    Config,
    cli_flag,
    env_var,
    plain,
    toml_key,
    toml_name,
    toml_value,
    validated,
)
from prefixd.errors import ConfigError
from prefixd.paths import default_data_dir, default_socket
from prefixd.store.config import format_size

log = logging.getLogger(__name__)

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
        for name, source, raw in _file_settings(path):
            given.setdefault(name, []).append(
                _convert(name, raw, source, text=False, base=path.parent)
            )
    for name in sorted(set(given) & set(DEPRECATED)):
        log.warning("%s: deprecated, taken in this release only; %s", name, DEPRECATED[name])
    values = {name: _agreed(name, items) for name, items in given.items()}
    instance = values.get("instance", "")
    for name, default in (("data_dir", default_data_dir), ("socket", default_socket)):
        if name not in values:
            values[name] = _attributed(name, default(env, instance), "the default")
    return Config.from_settings(**values), frozenset(given)


def parse_setting(name: str, text: str, source: str) -> Any:
    """One setting's value from text as its flag writes it (bench/tuned.py's knobs)."""
    if name not in SETTINGS:
        raise ConfigError(f"{source}: unknown setting {_with_hint(name, name, SETTINGS)}")
    return _convert(name, text, source, text=True, base=Path.cwd()).value


def config_from_args(namespace: argparse.Namespace, env: Mapping[str, str]) -> Config:
    """Glue for the CLI: the flags `add_arguments` put in namespace, plus env and --config."""
    cli = {name: getattr(namespace, name) for name in SETTINGS if hasattr(namespace, name)}
    return config_from_sources(cli, env, getattr(namespace, "config", None))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """serve's flags: --config and one --field-name flag per setting, grouped by TOML table."""
    add_config_flag(parser)
    for table, names in TABLES.items():
        group = parser.add_argument_group(
            f"[{table}] settings",
            f"each also settable as {ENV_PREFIX}<NAME> or in the --config file's [{table}]; "
            "a setting given twice must have the same value",
        )
        add_setting_flags(group, names)


def add_config_flag(where: Any) -> None:
    """--config FILE (`where`: a parser or an argument group)."""
    where.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help=f"TOML file of settings, in the tables of serve --print-config [{CONFIG_ENV}]",
    )


def add_setting_flags(where: Any, names: Iterable[str]) -> None:
    """The flags of settings `names`, as serve has them; a flag not given leaves its name unset in
    the namespace. Deprecated ones are taken but not listed."""
    for name in names:
        meta = META[name]
        kind, choices, default = meta["kind"], meta["choices"], DEFAULTS[name]
        shown = "" if default is MISSING else _shown_default(name, default)
        shown = f" (default {shown})" if shown else ""
        key = f"; {toml_key(name)} in the file" if toml_key(name) != name else ""
        help_text = f"{meta['help']}{shown} [{env_var(name)}{key}]".replace("%", "%%")
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if kind == "bool" else {}
        where.add_argument(
            cli_flag(name),
            dest=name,
            default=argparse.SUPPRESS,
            metavar="{" + ",".join(choices) + "}" if choices else KINDS[kind].metavar,
            help=argparse.SUPPRESS if name in DEPRECATED else help_text,
            **extra,
        )


def reference() -> str:
    """docs/settings.md: each table's settings with their flag, variable, default and help, the
    same text --help shows (tests/config/test_reference.py keeps the file equal to it)."""
    lines = [
        "# Settings of `prefixd serve`",
        "",
        'Generated from prefixd/config, as `prefixd serve --help`; see README "Operating a node".',
    ]
    for table, names in TABLES.items():
        lines += ["", f"## [{table}]", "", "| key | flag | variable | default | what |"]
        lines.append("|---|---|---|---|---|")
        for name in (n for n in names if n not in DEPRECATED):
            default = DEFAULTS[name]
            computed = default is MISSING or "(default " in META[name]["help"]  # the machine's
            shown = "computed" if computed else _shown_default(name, default) or '""'
            what = META[name]["help"].replace("|", "\\|")
            lines.append(
                f"| `{toml_key(name)}` | `{cli_flag(name)}` | `{env_var(name)}` | {shown} | {what} |"
            )
    return "\n".join(lines) + "\n"


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
        names = ", ".join(
            _with_hint(key, key.removeprefix(ENV_PREFIX).lower(), SETTINGS) for key in unknown
        )
        raise ConfigError(
            f"environment: unknown variable(s) {names}; every {ENV_PREFIX}* variable must name a "
            "setting"
        )
    return {known[key]: env[key] for key in ours}


def _file_settings(path: Path) -> list[tuple[str, str, Any]]:
    """(setting, where the file gives it, raw value) of each: the keys of its tables, and, deprecated, a
    setting as a top-level key (warned once, naming its table). Unknown keys are an error."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror or exc}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from None
    found: list[tuple[str, str, Any]] = []
    unknown = []
    for top, value in data.items():
        if top in TABLES and isinstance(value, dict):
            keys = {toml_key(name): name for name in TABLES[top]}
            for key, raw in value.items():
                if key in keys:
                    found.append((keys[key], f"[{top}] {key} in {path}", raw))
                else:
                    unknown.append(_with_hint(f"[{top}] {key}", key, tuple(keys)))
        elif top in SETTINGS:
            log.warning(
                "config: %s at the top level of %s is deprecated; write it as %s",
                top,
                path,
                toml_name(top),
            )
            found.append((top, f"{top} in {path}", value))
        elif top in TABLES:
            raise ConfigError(f"config: {top} in {path} must be a table ([{top}])")
        else:
            unknown.append(_with_hint(top, top, SETTINGS))
    if unknown:
        raise ConfigError(
            f"config: unknown setting(s) in {path}: {', '.join(sorted(unknown))}; settings are "
            "keys of the tables [store], [socket], [tenants], [limits], [metrics], [events] and "
            "[cluster] (see prefixd serve --print-config)"
        )
    return found


def _with_hint(shown: str, probe: str, known: tuple[str, ...]) -> str:
    """An unknown name as its source spells it, plus the known one it probably meant."""
    close = difflib.get_close_matches(probe, known, n=1)
    if not close:
        return shown
    suggestion = env_var(close[0]) if shown.startswith(ENV_PREFIX) else close[0]
    return f"{shown} (did you mean {suggestion}?)"


def _convert(name: str, raw: Any, source: str, *, text: bool, base: Path) -> _Given:
    """Parse and validate one source's raw value; errors name the setting and the source."""
    kind = KINDS[META[name]["kind"]]
    if text and name == "instance" and raw == "":  # `--instance "$GPU"`, GPU unset: no default
        raise ConfigError(f"instance: empty (set by {source}); leave it out for the default daemon")
    if META[name]["optional"] and raw in ("", None):
        return _Given(source, raw, None)  # an optional path given empty: off
    if isinstance(raw, str) and (text or kind.text_in_toml):
        try:
            value = kind.parse(raw)
        except ValueError:
            raise ConfigError(f"{name}: {raw!r} from {source} is not {kind.expected}") from None
    elif kind.accepts(raw):
        value = raw
    else:
        raise ConfigError(f"{name}: {source} must be {kind.typed}, got {type_name(raw)} {raw!r}")
    if META[name]["kind"] == "path" and value is not None:
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
    raw = _text(item.raw)
    effective = _text(plain(name, item.value))
    return raw if raw == effective else f"{raw} (= {effective})"


def _shown_default(name: str, default: Any) -> str:
    kind = META[name]["kind"]
    if kind == "size":
        return format_size(default)
    if kind == "ids":
        return ",".join(map(str, default)) or "none"
    return _text(plain(name, default))


def _text(value: Any) -> str:
    """A plain value for a message: strings unquoted, everything else as TOML writes it."""
    return value if isinstance(value, str) else toml_value(value)
