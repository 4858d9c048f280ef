"""Settings of `prefixd serve`: one typed Config fed by a TOML file, PREFIXD_* variables and flags.

Each setting has one name per source: its field name gives the flag and the variable, its table
(TABLES) the TOML key:

    field        TOML                     environment            flag
    workers      [store] workers = 8      PREFIXD_WORKERS=8      --workers 8
    socket_mode  [socket] mode = "0660"   PREFIXD_SOCKET_MODE    --socket-mode

The file's tables are those of `prefixd serve --print-config`, itself a valid file; a setting as a
top-level key (the old flat file) still works, with a warning naming its table. Relative paths in
the file are relative to its directory, those of flags and variables to the working directory.

There is no precedence: a setting given by two sources must have the same value in both (compared
after parsing, so "16MiB" and 16777216 agree), else ConfigError names both sources. Unknown keys and
unknown PREFIXD_* variables are errors, so a misspelt setting is never silently ignored.
`prefixd.config.sources` reads the sources and agrees them into one Config.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

from prefixd.config.events import EventSettings
from prefixd.config.policy import TenantPolicy
from prefixd.errors import ConfigError
from prefixd.paths import check_instance
from prefixd.store.config import (
    COMPRESSIONS,
    READ_PATHS,
    Durability,
    StoreConfig,
)
from prefixd.trust import resolve_user

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
    instance: str = _setting(
        "text",
        "which of several daemons on this node (one per GPU or NUMA node, prefixd@NAME.service): "
        "NAME makes the default store and socket /var/lib/prefixd-NAME and "
        "/run/prefixd-NAME/prefixd.sock as root (else prefixd-NAME under the XDG directories)",
        "",
    )
    daemon_user: str = _setting(
        "text",
        "the user the daemon runs as (a name or uid): clients and commands trust a socket of "
        "this user (besides root); serve refuses to start as another (default: clients trust "
        "root, their own user and the prefixd service user)",
        "",
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
        "the Mooncake master (HOST:PORT) of a shared tier behind the local store (empty: off)",
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
    cluster_client: str = _setting(
        "choice",
        "where the shared tier's client runs: a child process ('process': nothing Mooncake "
        "does can stall the daemon) or the daemon itself ('inline')",
        "process",
        choices=("process", "inline"),
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
    verify_threads: int = _store(
        "verify_threads",
        "int",
        "threads verifying checksums on reads (default about one per usable core, at least 2)",
    )
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
            object.__setattr__(self, name, validated(name, getattr(self, name)))
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
        return {name: plain(name, getattr(self, name)) for name in SETTINGS}

    def toml(self) -> str:
        """The effective settings as a TOML file `--config` accepts, a table per group, each
        setting with its help; a benchmark knob only where it is not its default."""
        described = self.describe()
        lines = []
        for table, names in TABLES.items():
            lines.append(f"[{table}]")
            for name in names:
                if name in BENCH_KNOBS and getattr(self, name) == DEFAULTS[name]:
                    continue
                lines.append(f"# {META[name]['help']}")
                lines.append(f"{toml_key(name)} = {toml_value(described[name])}")
            lines.append("")
        return "\n".join(lines)


SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(Config))
STORE_SETTINGS: tuple[str, ...] = tuple(
    f.name for f in fields(StoreConfig) if f.name not in ("path", "create")
)
META: dict[str, Mapping[str, Any]] = {f.name: f.metadata for f in fields(Config)}
DEFAULTS = {f.name: f.default for f in fields(Config)}

# The TOML tables, each setting in one (in --help's and --print-config's order); a table's key
# drops the prefix its settings share: [cluster] master is cluster_master, [socket] mode is
# socket_mode.
TABLES: dict[str, tuple[str, ...]] = {
    table: tuple(names.split())
    for table, names in {
        "store": "data_dir instance workers model_manifests map_size durability sync_interval_s "
        "compression zstd_level min_compression_gain chunk_bytes verify_threads readahead "
        "read_path max_readers verified_cache_bytes capacity_bytes high_watermark low_watermark "
        "eviction",
        "socket": "socket socket_mode daemon_user allowed_uids allowed_gids",
        "tenants": "tenant_policy tenant_quota_bytes tenant_quotas tenant_ttls share_groups",
        "limits": "max_connections max_connections_per_uid max_inflight max_frame_bytes "
        "max_region_bytes max_prompt_tokens max_request_tokens min_reusable_tokens "
        "handshake_timeout_s frame_timeout_s idle_timeout_s load_deadline_s shutdown_grace_s",
        "metrics": "metrics_port metrics_address metrics_textfile metrics_interval_s "
        "metrics_textfile_mode prefill_tokens_per_s log_level",
        "events": " ".join(name for name in SETTINGS if name.startswith("kv_events_")),
        "cluster": " ".join(name for name in SETTINGS if name.startswith("cluster_")),
    }.items()
}
TABLE_PREFIXES = {
    "socket": "socket_",
    "tenants": "tenant_",
    "metrics": "metrics_",
    "events": "kv_events_",
    "cluster": "cluster_",
}
TABLE_OF = {name: table for table, names in TABLES.items() for name in names}
# Knobs that exist to compare against in bench/ (eviction=lru, the cluster client inline, a read
# path forced): not in serve's --help nor the settings reference; a benchmark sets them through
# StoreConfig, and serve still takes them for one release, with a warning.
BENCH_KNOBS = ("eviction", "read_path", "cluster_client")


def toml_key(name: str) -> str:
    """The key of a setting in its table: cluster_master -> master, socket -> path."""
    key = name.removeprefix(TABLE_PREFIXES.get(TABLE_OF[name], "\0"))
    return "path" if key == "socket" else key


def toml_name(name: str) -> str:
    """The setting as a TOML file names it, for messages: [cluster] master."""
    return f"[{TABLE_OF[name]}] {toml_key(name)}"


def env_var(name: str) -> str:
    """The environment variable of a setting: workers -> PREFIXD_WORKERS."""
    return ENV_PREFIX + name.upper()


def cli_flag(name: str) -> str:
    """The flag of a setting: max_frame_bytes -> --max-frame-bytes."""
    return "--" + name.replace("_", "-")


def toml_value(value: Any) -> str:
    """A TOML value: JSON's string escapes are TOML's too, and arrays read the same."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return json.dumps(str(value), ensure_ascii=False)


# --- validating typed values -------------------------------------------------------------------


def validated(name: str, value: Any) -> Any:
    """The normalized value of one setting, or ConfigError "<name>: <problem>": its kind's type
    and range, then what that setting alone needs (_CHECKS)."""
    if name in STORE_SETTINGS:
        return getattr(StoreConfig(path=Path("."), **{name: value}), name)
    if META[name]["optional"] and value in (None, ""):
        return None  # an optional path left empty: the feature is off
    value = _typed(name, value, META[name])
    if value and name in _CHECKS:
        try:
            _CHECKS[name](value)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    return value


def _typed(name: str, value: Any, meta: Mapping[str, Any]) -> Any:
    kind = meta["kind"]
    if kind == "path":
        if not isinstance(value, (str, os.PathLike)) or not str(value):
            raise ConfigError(f"{name}: must be a path, got {value!r}")
        return Path(value)
    if kind == "entries":  # model_manifests, tenant_policy (store settings: StoreConfig above)
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{name}: must be a list of NAME=VALUE entries")
        return tuple(value)
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


def _short_socket(path: Path) -> None:
    if len(os.fsencode(path)) > SOCKET_PATH_MAX:
        raise ValueError(
            f"{path} is {len(os.fsencode(path))} bytes long, a Unix socket path can be at most "
            f"{SOCKET_PATH_MAX}; choose a shorter one"
        )


def _prom_file(path: Path) -> None:
    if path.suffix != ".prom":
        raise ValueError(
            f"{path} does not end in .prom, and node_exporter's textfile collector reads only "
            "*.prom files"
        )


def _known_user(user: str) -> None:
    try:
        resolve_user(user)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


# What a setting needs besides its kind's checks, for a value given (not empty): a ValueError is
# named after the setting, a ConfigError says it all.
_CHECKS: dict[str, Callable[[Any], object]] = {
    "socket": _short_socket,
    "metrics_textfile": _prom_file,
    "tenant_policy": lambda entries: TenantPolicy(entries, os.geteuid()),
    "model_manifests": lambda entries: parse_manifests(entries),  # defined below
    "instance": check_instance,
    "daemon_user": _known_user,
}


def _check_int(name: str, kind: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        formats: dict[str, Callable[[int], str]] = {
            "size": format_size,
            "mode": lambda n: f"{n:#o}",
        }
        show = formats.get(kind, str)
        raise ConfigError(f"{name}: must be in [{show(low)}, {show(high)}], got {show(value)}")


def format_size(n: int) -> str:
    """16777216 -> '16MiB': the largest unit that divides n exactly."""
    for unit, factor in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n and n % factor == 0:
            return f"{n // factor}{unit}"
    return str(n)


def plain(name: str, value: Any) -> Any:
    """A setting as a JSON/TOML-able value that parses back to the same setting."""
    if isinstance(value, Path):
        return str(value)
    if value is None:
        return ""  # an optional path that is off
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple):
        return list(value)
    if META[name]["kind"] == "mode":
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
