"""Settings of `prefixd serve`: one typed Config fed by a TOML file, PREFIXD_* variables and flags.

Every setting has exactly one name per source, derived from its field name, never from a table:

    field      TOML key (top level)   environment          flag
    workers    workers = 8            PREFIXD_WORKERS=8    --workers 8

The TOML file holds the settings as top-level keys; there is no `[prefixd]` table, so the output
of `prefixd serve --print-config` is itself a valid file. Relative paths in the file are relative to
the file's directory; relative paths from flags and the environment are relative to the working
directory. The file is named by `--config` or PREFIXD_CONFIG.

There is no precedence: a setting given by two sources must have the same value in both (compared
after parsing, so "16MiB" and 16777216 agree), else ConfigError names both sources: nobody has to
guess whether a unit file's Environment= or the config file won. Unknown TOML keys and unknown
PREFIXD_* variables are errors, so a misspelt setting is never silently ignored.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from prefixd.daemon.events import EventSettings
from prefixd.daemon.policy import TenantPolicy
from prefixd.errors import ConfigError
from prefixd.store.config import (
    COMPRESSIONS,
    READ_PATHS,
    Durability,
    StoreConfig,
    parse_seconds,
    parse_size,
)

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40

ENV_PREFIX = "PREFIXD_"
CONFIG_ENV = "PREFIXD_CONFIG"
LOG_LEVELS = ("debug", "info", "warning", "error")
LOOPBACKS = ("127.0.0.1", "::1")
SOCKET_PATH_MAX = 107  # sun_path is 108 bytes on Linux, one of them the terminating NUL
MAX_ID = (1 << 32) - 2  # uid_t/gid_t; 2**32 - 1 is (uid_t)-1, which means "no id"

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
_STORE_DEFAULTS = {f.name: f.default for f in fields(StoreConfig)}


def _setting(
    kind: str,
    doc: str,
    default: Any = MISSING,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] = (),
    optional: bool = False,
) -> Any:
    """One Config field: its default plus what parsing, validation and --help need to know.
    An `optional` path defaults to None (off), and an empty value turns it off."""
    meta = {
        "kind": kind,
        "help": doc,
        "low": low,
        "high": high,
        "choices": choices,
        "optional": optional,
    }
    return field(default=default, metadata=meta)


def _store(name: str, kind: str, doc: str, choices: tuple[str, ...] = ()) -> Any:
    """A field mirrored from StoreConfig: same default; StoreConfig itself validates it."""
    return _setting(kind, doc, _STORE_DEFAULTS[name], choices=choices)


@dataclass(frozen=True)
class Config:
    """Everything `prefixd serve` can be told; every field is validated on construction.

    Who may connect: a peer (as SO_PEERCRED and SO_PEERGROUPS report it at connect) is allowed if
    its uid is 0, equals the daemon's uid, is in `allowed_uids`, or its primary gid or one of its
    supplementary groups is in `allowed_gids`. The socket's file mode is a second, independent
    gate: a peer also needs write permission on the socket file to connect at all.

    data_dir and socket have no static default: `config_from_sources` computes them from the
    environment (see `default_data_dir`, `default_socket`).
    """

    data_dir: Path = _setting(
        "path",
        "store directory (default: $STATE_DIRECTORY, /var/lib/prefixd as root, "
        "else $XDG_STATE_HOME/prefixd or ~/.local/state/prefixd)",
    )
    socket: Path = _setting(
        "path",
        "Unix socket to listen on (default: $RUNTIME_DIRECTORY/prefixd.sock, "
        "/run/prefixd/prefixd.sock as root, else $XDG_RUNTIME_DIR/prefixd/prefixd.sock "
        "or /tmp/prefixd-UID/prefixd.sock)",
    )
    socket_mode: int = _setting("mode", "file mode of the socket, octal", 0o660, low=0, high=0o777)
    allowed_uids: tuple[int, ...] = _setting(
        "ids", "uids allowed to connect besides root and the daemon's own uid", ()
    )
    allowed_gids: tuple[int, ...] = _setting("ids", "gids whose members may connect", ())
    tenant_policy: tuple[str, ...] = _setting(
        "entries",
        "which tenants and administrative operations each peer may use, uid:N=GRANT+... or "
        "gid:N=...; a grant is a tenant, * (every tenant) or op:purge|retire|verify|hot|* "
        "(none: every allowed peer may use every tenant)",
        (),
    )
    max_frame_bytes: int = _setting(
        "size", "largest protocol frame accepted", 16 * MiB, low=4 * KiB, high=1 * GiB
    )
    workers: int = _setting("int", "threads for blocking store work", 4, low=1, high=256)
    max_connections: int = _setting(
        "int", "connections served at once; more are refused", 1024, low=1, high=65536
    )
    max_inflight: int = _setting("int", "requests in flight per connection", 64, low=1, high=4096)
    max_connections_per_uid: int = _setting(
        "int", "connections one uid may hold at once; more are refused", 256, low=1, high=65536
    )
    handshake_timeout_s: float = _setting(
        "seconds", "how long a new connection may take to say hello", 10.0, low=0.1, high=3600.0
    )
    frame_timeout_s: float = _setting(
        "seconds", "how long a frame may take to arrive once begun", 30.0, low=0.1, high=3600.0
    )
    idle_timeout_s: float = _setting(
        "seconds",
        "how long a connection may go without a request before it is closed (0: never, as "
        "engines hold theirs for the life of the process)",
        0.0,
        low=0.0,
        high=7 * 86400.0,
    )
    load_deadline_s: float = _setting(
        "seconds",
        "how long a load may read before the daemon answers the verified prefix it has (slow "
        "storage; 0: no limit; a client's deadline_s overrides it)",
        0.0,
        low=0.0,
        high=86400.0,
    )
    max_region_bytes: int = _setting(
        "size", "largest shared region a client may attach", 64 * GiB, low=1 * MiB, high=1 * TiB
    )
    max_prompt_tokens: int = _setting(
        "int",
        "most token ids (or engine key words) one prompt may hold; more are refused before any "
        "hashing",
        4 << 20,
        low=1024,
        high=1 << 30,
    )
    max_request_tokens: int = _setting(
        "int",
        "most token ids all the prompts of one request may hold together",
        16 << 20,
        low=1024,
        high=1 << 31,
    )
    shutdown_grace_s: float = _setting(
        "seconds",
        "how long shutdown waits for requests and store work in flight",
        10.0,
        low=0.0,
        high=3600.0,
    )
    log_level: str = _setting("choice", "log verbosity", "info", choices=LOG_LEVELS)
    model_manifests: tuple[str, ...] = _setting(
        "entries",
        "models this node serves, each with the files that fingerprint its weights "
        "(MODEL=FILE[+FILE...]); a change retires the model's other versions",
        (),
    )
    min_reusable_tokens: int = _setting(
        "int",
        "hits shorter than this many tokens are not offered (0: every hit)",
        0,
        low=0,
        high=1 << 31,
    )
    prefill_tokens_per_s: float = _setting(
        "float",
        "the engine's prefill throughput, tokens/s: what a loaded token saves, for the stats",
        10000.0,
        low=1.0,
        high=1e9,
    )
    metrics_port: int = _setting(
        "int", "serve Prometheus metrics over HTTP on this port (0: off)", 0, low=0, high=65535
    )
    metrics_address: str = _setting(
        "choice", "loopback address of the metrics port", "127.0.0.1", choices=LOOPBACKS
    )
    metrics_textfile: Path | None = _setting(
        "path",
        "write Prometheus metrics to this file for node_exporter's textfile collector (off if "
        "empty)",
        None,
        optional=True,
    )
    metrics_interval_s: float = _setting(
        "seconds", "how often the metrics textfile is rewritten", 15.0, low=1.0, high=86400.0
    )
    metrics_textfile_mode: int = _setting(
        "mode",
        "file mode of the metrics textfile, octal (it names tenants: not for every user)",
        0o640,
        low=0,
        high=0o777,
    )
    kv_events_endpoint: str = _setting(
        "text",
        "publish KV events (vLLM's KVEventBatch) on this ZeroMQ PUB endpoint, ipc://PATH or "
        "tcp://127.0.0.1:PORT (empty: off)",
        "",
    )
    kv_events_replay_endpoint: str = _setting(
        "text",
        "answer replay requests (the batches since a sequence number) on this ZeroMQ ROUTER "
        "endpoint (empty: off)",
        "",
    )
    kv_events_tenants: str = _setting(
        "text",
        "tenants whose blocks are published, comma-separated, or * for all (events carry "
        "prompt token ids; none: nothing is published)",
        "",
    )
    kv_events_hash_only: bool = _setting("bool", "publish block hashes and no token ids", False)
    kv_events_queue: int = _setting(
        "int",
        "events waiting for the publisher; more are dropped and counted, never waited for",
        100_000,
        low=1,
        high=1 << 24,
    )
    kv_events_replay_batches: int = _setting(
        "int", "event batches kept for replay requests", 10_000, low=1, high=1 << 20
    )
    kv_events_inventory_rate: int = _setting(
        "int",
        "blocks a second a start announces as stored (the store's inventory)",
        100_000,
        low=1,
        high=1 << 30,
    )
    cluster_master: str = _setting(
        "text",
        "the Mooncake master (HOST:PORT) of a shared tier behind the local store (empty: off); "
        "in a TOML file, `master` under [cluster]",
        "",
    )
    cluster_metadata: str = _setting(
        "text", "the Mooncake metadata server (a URL like http://HOST:PORT/metadata)", ""
    )
    cluster_local_hostname: str = _setting(
        "text", "this node's address as the shared tier's transfer engine sees it", "127.0.0.1"
    )
    cluster_timeout_s: float = _setting(
        "seconds",
        "how long a shared-tier call may take before it counts as failed",
        2.0,
        low=0.01,
        high=600.0,
    )
    cluster_segment_bytes: int = _setting(
        "size",
        "memory this node lends to the shared tier (0: none, else at least 16MiB)",
        256 * MiB,
        low=0,
        high=1 * TiB,
    )
    cluster_pending: int = _setting(
        "int",
        "blocks waiting to be published to the shared tier; more are dropped and counted",
        4096,
        low=1,
        high=1 << 20,
    )
    map_size: int = _store("map_size", "size", "LMDB map size: the store's largest size")
    durability: Durability = _store(
        "durability",
        "choice",
        "what an acknowledged put survives",
        tuple(d.value for d in Durability),
    )
    sync_interval_s: float = _store(
        "sync_interval_s", "seconds", "background sync interval under periodic durability"
    )
    compression: str = _store("compression", "choice", "payload compression", COMPRESSIONS)
    zstd_level: int = _store("zstd_level", "int", "zstd compression level")
    min_compression_gain: float = _store(
        "min_compression_gain", "float", "store a block raw unless compression saves this fraction"
    )
    chunk_bytes: int = _store("chunk_bytes", "size", "payload chunk size (even)")
    verify_threads: int = _store("verify_threads", "int", "threads verifying checksums on reads")
    readahead: bool = _store("readahead", "bool", "let the OS read ahead in the data file")
    read_path: str = _store(
        "read_path",
        "choice",
        "how loads read payloads stored raw: auto (large ones with preadv from the data file, "
        "small ones from LMDB's map), mmap or pread",
        READ_PATHS,
    )
    max_readers: int = _store("max_readers", "int", "LMDB reader slots")
    verified_cache_bytes: int = _store(
        "verified_cache_bytes", "size", "memory for recently verified prefixes (0: off)"
    )
    capacity_bytes: int = _store(
        "capacity_bytes", "size", "payload bytes the store may hold (0: 80% of map_size)"
    )
    high_watermark: float = _store(
        "high_watermark", "float", "evict when the stored bytes pass this share of the capacity"
    )
    low_watermark: float = _store(
        "low_watermark", "float", "evict down to this share of the capacity"
    )
    tenant_quota_bytes: int = _store(
        "tenant_quota_bytes", "size", "stored bytes each tenant may hold (0: no quota)"
    )
    tenant_quotas: tuple[str, ...] = _store(
        "tenant_quotas", "entries", "per-tenant quotas overriding tenant_quota_bytes, TENANT=SIZE"
    )
    tenant_ttls: tuple[str, ...] = _store(
        "tenant_ttls", "entries", "time to live of a tenant's entries, TENANT=DURATION (7d)"
    )
    share_groups: tuple[str, ...] = _store(
        "share_groups",
        "entries",
        "tenants that share identical entries, GROUP=TENANT+TENANT (never shared otherwise)",
    )
    eviction: str = _store(
        "eviction",
        "choice",
        "eviction order: value (per byte), lru, or none (a full store refuses puts)",
        ("value", "lru", "none"),
    )

    def __post_init__(self) -> None:
        for name in SETTINGS:
            object.__setattr__(self, name, _validated(name, getattr(self, name)))
        self.store_config()  # any check StoreConfig makes across fields
        if self.cluster_master and not self.cluster_metadata:
            raise ConfigError("cluster_metadata: required with cluster_master (the metadata URL)")
        if 0 < self.cluster_segment_bytes < 16 * MiB:
            raise ConfigError("cluster_segment_bytes: must be 0 or at least 16MiB")
        if self.kv_events_endpoint or self.kv_events_replay_endpoint:
            self.event_settings()  # the endpoints' checks

    def event_settings(self) -> EventSettings:
        """What the KV event publisher is told (prefixd.daemon.events)."""
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint: needs kv_events_endpoint")
        return EventSettings.parse(
            self.kv_events_endpoint,
            self.kv_events_tenants,
            replay_endpoint=self.kv_events_replay_endpoint,
            hash_only=self.kv_events_hash_only,
            queue_events=self.kv_events_queue,
            replay_batches=self.kv_events_replay_batches,
            inventory_rate=self.kv_events_inventory_rate,
        )

    def store_config(self) -> StoreConfig:
        """The store's settings: data_dir as the path, created on first start."""
        values = {name: getattr(self, name) for name in STORE_SETTINGS}
        return StoreConfig(path=self.data_dir, create=True, **values)

    def describe(self) -> dict[str, Any]:
        """The effective settings as JSON-able values; written as TOML, they load back unchanged."""
        return {name: _plain(name, getattr(self, name)) for name in SETTINGS}

    def toml(self) -> str:
        """The effective settings as a TOML file `--config` accepts, each with its help."""
        lines = []
        for name, value in self.describe().items():
            lines.append(f"# {_META[name]['help']}")
            lines.append(f"{name} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(Config))
STORE_SETTINGS: tuple[str, ...] = tuple(
    f.name for f in fields(StoreConfig) if f.name not in ("path", "create")
)
_META: dict[str, Mapping[str, Any]] = {f.name: f.metadata for f in fields(Config)}


def env_var(name: str) -> str:
    """The environment variable of a setting: workers -> PREFIXD_WORKERS."""
    return ENV_PREFIX + name.upper()


def cli_flag(name: str) -> str:
    """The flag of a setting: max_frame_bytes -> --max-frame-bytes."""
    return "--" + name.replace("_", "-")


# --- defaults that depend on the environment -------------------------------------------------


def default_data_dir(env: Mapping[str, str]) -> Path:
    """Where the store lives unless told: systemd's StateDirectory=, else the FHS or XDG place."""
    if env.get("STATE_DIRECTORY"):
        return Path(env["STATE_DIRECTORY"].split(":")[0])  # several StateDirectory= are ':'-joined
    if os.geteuid() == 0:
        return Path("/var/lib/prefixd")
    return _xdg_dir(env, "XDG_STATE_HOME", ".local/state") / "prefixd"


def default_socket(env: Mapping[str, str]) -> Path:
    """Where the socket lives unless told: systemd's RuntimeDirectory=, else /run or XDG or /tmp."""
    if env.get("RUNTIME_DIRECTORY"):
        return Path(env["RUNTIME_DIRECTORY"].split(":")[0]) / "prefixd.sock"
    if os.geteuid() == 0:
        return Path("/run/prefixd/prefixd.sock")
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):  # the XDG spec says to ignore relative values
        return Path(runtime) / "prefixd" / "prefixd.sock"
    return Path(f"/tmp/prefixd-{os.geteuid()}/prefixd.sock")


def _xdg_dir(env: Mapping[str, str], variable: str, fallback: str) -> Path:
    value = env.get(variable, "")
    if os.path.isabs(value):
        return Path(value)
    return (Path(env["HOME"]) if env.get("HOME") else Path.home()) / fallback


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
    for name, default in (("data_dir", default_data_dir), ("socket", default_socket)):
        if name not in values:
            values[name] = _attributed(name, default(env), "the default")
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
    kind = _META[name]["kind"]
    if _META[name]["optional"] and raw in ("", None):
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
        return _validated(name, value)
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
    effective = _text(_plain(name, item.value))
    return raw if raw == effective else f"{raw} (= {effective})"


def _shown_default(name: str, default: Any) -> str:
    kind = _META[name]["kind"]
    if kind == "size":
        return _format_size(default)
    if kind == "ids":
        return ",".join(map(str, default)) or "none"
    return _text(_plain(name, default))


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


def _toml_value(value: Any) -> str:
    """A TOML value: JSON's string escapes are TOML's too, and arrays read the same."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


def _text(value: Any) -> str:
    """A plain value for a message: strings unquoted, everything else as TOML writes it."""
    return value if isinstance(value, str) else _toml_text(value)


# --- validating typed values -------------------------------------------------------------------


def _validated(name: str, value: Any) -> Any:
    """The normalized value of one setting, or ConfigError "<name>: <problem>"."""
    if name in STORE_SETTINGS:
        return getattr(StoreConfig(path=Path("."), **{name: value}), name)
    meta = _META[name]
    kind = meta["kind"]
    if meta["optional"] and value in (None, ""):
        return None  # an optional path left empty: the feature is off
    if kind == "path":
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ConfigError(f"{name}: must be a path, got {value!r}")
        path = Path(value)
        if name == "socket" and len(os.fsencode(path)) > SOCKET_PATH_MAX:
            raise ConfigError(
                f"{name}: {path} is {len(os.fsencode(path))} bytes long, a Unix socket path can be "
                f"at most {SOCKET_PATH_MAX}; choose a shorter one"
            )
        if name == "metrics_textfile" and path.suffix != ".prom":
            raise ConfigError(
                f"{name}: {path} does not end in .prom, and node_exporter's textfile collector "
                "reads only *.prom files"
            )
        return path
    if kind == "entries":  # model_manifests, tenant_policy (store settings: StoreConfig above)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: must be a list of NAME=VALUE entries")
        entries = tuple(value)
        if name == "tenant_policy":
            TenantPolicy(entries, os.geteuid())  # raises ConfigError naming what is wrong
            return entries
        try:
            parse_manifests(entries)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
        return entries
    if kind == "ids":
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: must be a list of integers, got {type(value).__name__}")
        for item in value:
            _check_int(name, kind, item, 0, MAX_ID)
        return tuple(value)
    if kind == "text":
        if not isinstance(value, str) or len(value) > 4096 or "\n" in value:
            raise ConfigError(f"{name}: must be one line of text, got {value!r}")
        return value
    if kind == "bool":  # only the daemon's own (the store's are StoreConfig's, above)
        if not isinstance(value, bool):
            raise ConfigError(f"{name}: must be true or false, got {type(value).__name__}")
        return value
    if kind == "choice":
        if value not in meta["choices"]:
            raise ConfigError(f"{name}: must be one of {', '.join(meta['choices'])}, got {value!r}")
        return value
    if kind in ("float", "seconds"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}: must be a number, got {type(value).__name__}")
        if not meta["low"] <= value <= meta["high"]:
            raise ConfigError(f"{name}: must be in [{meta['low']}, {meta['high']}], got {value}")
        return float(value)
    _check_int(name, kind, value, meta["low"], meta["high"])
    return value


def _check_int(name: str, kind: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        formats: dict[str, Callable[[int], str]] = {
            "size": _format_size,
            "mode": lambda n: f"{n:#o}",
        }
        show = formats.get(kind, str)
        raise ConfigError(f"{name}: must be in [{show(low)}, {show(high)}], got {show(value)}")


def _format_size(n: int) -> str:
    """16777216 -> '16MiB': the largest unit that divides n exactly."""
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def _plain(name: str, value: Any) -> Any:
    """A setting as a JSON/TOML-able value that parses back to the same setting."""
    if isinstance(value, Path):
        return str(value)
    if value is None:
        return ""  # an optional path that is off
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if _META[name]["kind"] == "mode":
        return f"{value:04o}"
    return value


def parse_manifests(entries: tuple[str, ...]) -> dict[str, tuple[Path, ...]]:
    """{model: manifest files} from MODEL=FILE[+FILE...] entries; ValueError says what is wrong."""
    models: dict[str, tuple[Path, ...]] = {}
    for entry in entries:
        model, sep, files = entry.partition("=")
        paths = tuple(Path(f).expanduser() for f in files.split("+") if f)
        if not sep or not model or not paths:
            raise ValueError(f"{entry!r} is not MODEL=FILE[+FILE...]")
        if model in models:
            raise ValueError(f"model {model!r} is listed twice")
        if not all(p.is_absolute() for p in paths):
            raise ValueError(f"{entry!r}: manifest files must be absolute paths")
        models[model] = paths
    return models
