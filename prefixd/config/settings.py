"""Settings of `prefixd serve`: one typed Config of seven groups, fed by a TOML file, PREFIXD_*
variables and flags.

Each setting has one name per source: its flat name gives the flag and the variable, its group
the TOML table and the attribute:

    Config            TOML                     environment            flag
    store.workers     [store] workers = 8      PREFIXD_WORKERS=8      --workers 8
    socket.mode       [socket] mode = "0660"   PREFIXD_SOCKET_MODE    --socket-mode

A setting as a top-level key (the old flat file) still works, with a warning naming its table.
Relative paths in the file are relative to its directory, those of flags and variables to the
working directory. There is no precedence: a setting given by two sources must have the same value
in both (compared after parsing, so "16MiB" and 16777216 agree), else ConfigError names both.
Unknown keys and unknown PREFIXD_* variables are errors, so a misspelt setting is never ignored.
A deprecated setting is still taken, with a warning, for one release and listed nowhere.
`prefixd.config.sources` reads the sources and agrees them into one Config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

from prefixd.config.kinds import typed
from prefixd.config.policy import TenantPolicy
from prefixd.errors import ConfigError
from prefixd.paths import check_instance
from prefixd.store.config import (
    COMPRESSIONS,
    READ_PATHS,
    SHARE_PREFIX,
    Durability,
    StoreConfig,
    tenant_entries,
)
from prefixd.store.journal import BlockChange
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
FIXED = "no longer a setting: from the next release it is fixed at its default"
BENCH = "a benchmark knob: benchmarks set it through the library's StoreConfig"


def _default(item: Any) -> Any:
    """A field's default, made by its factory where it has one (a map)."""
    return item.default if item.default_factory is MISSING else item.default_factory()


_STORE_DEFAULTS = {f.name: _default(f) for f in fields(StoreConfig)}


def _setting(
    kind: str,
    doc: str,
    default: Any = MISSING,
    *,
    low: float | None = None,
    high: float | None = None,
    choices: tuple[str, ...] = (),
    optional: bool = False,
    name: str = "",
    deprecated: str = "",
) -> Any:
    """One group field: its default plus what parsing, validation and --help need. `name` is its
    flat name where that is not the group's prefix plus the field's; an `optional` path defaults to
    None (off); `deprecated` says what to do instead of setting it."""
    meta = {"kind": kind, "help": doc, "low": low, "high": high, "choices": choices}
    meta |= {"optional": optional, "name": name, "deprecated": deprecated}
    if isinstance(default, dict):
        return field(default_factory=dict, metadata=meta)
    return field(default=default, metadata=meta)


def _store(name: str, kind: str, doc: str, *, deprecated: str = "", **meta: Any) -> Any:
    """A field mirrored from StoreConfig: same default; StoreConfig itself validates it."""
    return _setting(kind, doc, _STORE_DEFAULTS[name], name=name, deprecated=deprecated, **meta)


class _Group:
    """Each field is validated on construction (see `validated`)."""

    prefix: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for item in fields(self):  # type: ignore[arg-type]
            value = validated(flat_name(type(self), item), getattr(self, item.name))
            object.__setattr__(self, item.name, value)


@dataclass(frozen=True)
class StoreSettings(_Group):
    """data_dir has no static default: `config_from_sources` computes it (`default_data_dir`)."""

    data_dir: Path = _setting(
        "path",
        "store directory (default: $STATE_DIRECTORY, /var/lib/prefixd as root or the service "
        "user prefixd, else $XDG_STATE_HOME/prefixd or ~/.local/state/prefixd)",
    )
    instance: str = _setting(
        "text",
        "which of several daemons on this node (one per GPU or NUMA node, prefixd@NAME.service): "
        "NAME makes the default store and socket /var/lib/prefixd-NAME and "
        "/run/prefixd-NAME/prefixd.sock as root (else prefixd-NAME under the XDG directories)",
        "",
    )
    workers: int = _setting("int", "threads for blocking store work", 4, low=1, high=256)
    model_manifests: Mapping[str, tuple[Path, ...]] = _setting(
        "entries",
        "models this node serves, each with the files that fingerprint its weights "
        "(MODEL=FILE[+FILE...]); a change retires the model's other versions",
        {},
    )
    map_size: int = _store("map_size", "size", "LMDB map size: the store's largest size")
    durability: Durability = _store(
        "durability",
        "choice",
        "what an acknowledged put survives",
        choices=tuple(d.value for d in Durability),
    )
    sync_interval_s: float = _store(
        "sync_interval_s", "seconds", "background sync interval under periodic durability"
    )
    compression: str = _store("compression", "choice", "payload compression", choices=COMPRESSIONS)
    capacity_bytes: int = _store(
        "capacity_bytes", "size", "payload bytes the store may hold (0: 80% of map_size)"
    )
    zstd_level: int = _store("zstd_level", "int", "zstd compression level", deprecated=FIXED)
    min_compression_gain: float = _store(
        "min_compression_gain",
        "float",
        "store a block raw unless compression saves this fraction",
        deprecated=FIXED,
    )
    chunk_bytes: int = _store("chunk_bytes", "size", "payload chunk size", deprecated=FIXED)
    verify_threads: int = _store(
        "verify_threads", "int", "threads verifying checksums on reads", deprecated=FIXED
    )
    readahead: bool = _store("readahead", "bool", "OS readahead in the data file", deprecated=FIXED)
    read_path: str = _store(
        "read_path", "choice", "how loads read raw payloads", choices=READ_PATHS, deprecated=BENCH
    )
    max_readers: int = _store("max_readers", "int", "LMDB reader slots", deprecated=FIXED)
    verified_cache_bytes: int = _store(
        "verified_cache_bytes", "size", "memory for verified prefixes", deprecated=FIXED
    )
    high_watermark: float = _store(
        "high_watermark", "float", "evict past this share of the capacity", deprecated=FIXED
    )
    low_watermark: float = _store(
        "low_watermark", "float", "evict down to this share of the capacity", deprecated=FIXED
    )
    eviction: str = _store(
        "eviction",
        "choice",
        "eviction order",
        choices=("value", "lru", "none"),
        deprecated=BENCH,
    )


@dataclass(frozen=True)
class SocketSettings(_Group):
    """Who may connect: a peer (as SO_PEERCRED and SO_PEERGROUPS report it at connect) is allowed if
    its uid is 0, equals the daemon's uid, is in `allowed_uids`, or one of its groups is in
    `allowed_gids`. The socket's file mode is a second gate: a peer also needs write permission on
    the socket file. path has no static default (`default_socket`)."""

    prefix: ClassVar[str] = "socket_"

    path: Path = _setting(
        "path",
        "Unix socket to listen on (default: $RUNTIME_DIRECTORY/prefixd.sock, "
        "/run/prefixd/prefixd.sock as root, else $XDG_RUNTIME_DIR/prefixd/prefixd.sock "
        "or /tmp/prefixd-UID/prefixd.sock)",
        name="socket",
    )
    mode: int = _setting("mode", "file mode of the socket, octal", 0o660, low=0, high=0o777)
    daemon_user: str = _setting(
        "text",
        "the user the daemon runs as (a name or uid): clients and commands trust a socket of "
        "this user (besides root); serve refuses to start as another (default: clients trust "
        "root, their own user and the prefixd service user)",
        "",
        name="daemon_user",
    )
    allowed_uids: tuple[int, ...] = _setting(
        "ids",
        "uids allowed to connect besides root and the daemon's own uid",
        (),
        name="allowed_uids",
    )
    allowed_gids: tuple[int, ...] = _setting(
        "ids", "gids whose members may connect", (), name="allowed_gids"
    )


@dataclass(frozen=True)
class TenantSettings(_Group):
    """Tenants and their limits, parsed into maps (the store's own, see StoreConfig)."""

    prefix: ClassVar[str] = "tenant_"

    policy: tuple[str, ...] = _setting(
        "entries",
        "which tenants and administrative operations each peer may use, uid:N=GRANT+... or "
        "gid:N=...; a grant is a tenant, * (every tenant) or op:purge|retire|verify|hot|* "
        "(none: every allowed peer may use every tenant)",
        (),
    )
    quotas: Mapping[str, int] = _store(
        "tenant_quotas",
        "entries",
        "stored bytes a tenant may hold, TENANT=SIZE; *=SIZE: each tenant not listed",
    )
    ttls: Mapping[str, float] = _store(
        "tenant_ttls", "entries", "time to live of a tenant's entries, TENANT=DURATION (7d)"
    )
    share_groups: Mapping[str, tuple[str, ...]] = _store(
        "share_groups",
        "entries",
        "tenants that share identical entries, GROUP=TENANT+TENANT (never shared otherwise)",
    )
    scrub_retired: bool = _store(
        "scrub_retired",
        "bool",
        "clear the store's files of retired model versions and expired entries too, as a "
        "tenant's purge always does (time in proportion to the free space, once per removal)",
    )
    quota_bytes: int = _store(
        "tenant_quota_bytes",
        "size",
        "stored bytes each tenant may hold",
        deprecated='write it as [tenants] quotas = ["*=SIZE"]',
    )


@dataclass(frozen=True)
class Limits(_Group):
    """What one peer may ask of the daemon, and how long it may take."""

    max_connections: int = _setting(
        "int", "connections served at once; more are refused", 1024, low=1, high=65536
    )
    max_connections_per_uid: int = _setting(
        "int", "connections one uid may hold at once; more are refused", 256, low=1, high=65536
    )
    max_inflight: int = _setting("int", "requests in flight per connection", 64, low=1, high=4096)
    max_region_bytes: int = _setting(
        "size", "largest shared region a client may attach", 64 * GiB, low=1 * MiB, high=1 * TiB
    )
    min_reusable_tokens: int = _setting(
        "int",
        "hits shorter than this many tokens are not offered (0: every hit)",
        0,
        low=0,
        high=1 << 31,
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
    shutdown_grace_s: float = _setting(
        "seconds",
        "how long shutdown waits for requests and store work in flight",
        10.0,
        low=0.0,
        high=3600.0,
    )
    max_frame_bytes: int = _setting(
        "size", "largest protocol frame", 16 * MiB, low=4 * KiB, high=1 * GiB, deprecated=FIXED
    )
    max_prompt_tokens: int = _setting(
        "int", "most token ids of one prompt", 4 << 20, low=1024, high=1 << 30, deprecated=FIXED
    )
    max_request_tokens: int = _setting(
        "int", "most token ids of one request", 16 << 20, low=1024, high=1 << 31, deprecated=FIXED
    )
    handshake_timeout_s: float = _setting(
        "seconds", "time to say hello", 10.0, low=0.1, high=3600.0, deprecated=FIXED
    )
    frame_timeout_s: float = _setting(
        "seconds", "time a begun frame may take", 30.0, low=0.1, high=3600.0, deprecated=FIXED
    )


@dataclass(frozen=True)
class MetricsSettings(_Group):
    prefix: ClassVar[str] = "metrics_"

    port: int = _setting(
        "int", "serve Prometheus metrics over HTTP on this port (0: off)", 0, low=0, high=65535
    )
    address: str = _setting(
        "choice", "loopback address of the metrics port", "127.0.0.1", choices=LOOPBACKS
    )
    textfile: Path | None = _setting(
        "path",
        "write Prometheus metrics to this file for node_exporter's textfile collector, mode 0640 "
        "(off if empty)",
        None,
        optional=True,
    )
    prefill_tokens_per_s: float = _setting(
        "float",
        "the engines' prefill throughput, tokens/s, until they report their own: a hit is offered "
        "only where loading it is faster than prefilling it",
        10000.0,
        low=1.0,
        high=1e9,
        name="prefill_tokens_per_s",
    )
    log_level: str = _setting(
        "choice", "log verbosity", "info", choices=LOG_LEVELS, name="log_level"
    )
    interval_s: float = _setting(
        "seconds", "textfile rewrite interval", 15.0, low=1.0, high=86400.0, deprecated=FIXED
    )
    textfile_mode: int = _setting(
        "mode", "file mode of the textfile", 0o640, low=0, high=0o777, deprecated=FIXED
    )


@dataclass(frozen=True)
class EventSettings(_Group):
    """What the KV event publisher (prefixd.daemon.events) is told. Events carry prompt token
    ids, so their endpoints stay on the node."""

    prefix: ClassVar[str] = "kv_events_"

    endpoint: str = _setting(
        "text",
        "publish KV events (vLLM's KVEventBatch) on this ZeroMQ PUB endpoint, ipc://PATH or "
        "tcp://127.0.0.1:PORT (empty: off)",
        "",
    )
    replay_endpoint: str = _setting(
        "text",
        "answer replay requests (the batches since a sequence number) on this ZeroMQ ROUTER "
        "endpoint (empty: off)",
        "",
    )
    tenants: frozenset[str] = _setting(
        "names",
        "tenants whose blocks are published, comma-separated, or * for all (events carry "
        "prompt token ids; none: nothing is published)",
        frozenset(),
    )
    hash_only: bool = _setting("bool", "publish block hashes and no token ids", False)
    queue: int = _setting(
        "int", "events waiting to be sent", 100_000, low=1, high=1 << 24, deprecated=FIXED
    )
    replay_batches: int = _setting(
        "int", "batches kept for replay", 10_000, low=1, high=1 << 20, deprecated=FIXED
    )
    inventory_rate: int = _setting(
        "int", "blocks/s announced at start", 100_000, low=1, high=1 << 30, deprecated=FIXED
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.replay_endpoint and not self.endpoint:
            raise ConfigError("kv_events_replay_endpoint: needs kv_events_endpoint")

    def publishes(self, change: BlockChange) -> bool:
        if "*" in self.tenants:
            return True
        return change.identity is not None and change.identity.tenant in self.tenants


@dataclass(frozen=True)
class ClusterSettings(_Group):
    """The Mooncake shared tier behind the local store."""

    prefix: ClassVar[str] = "cluster_"

    master: str = _setting(
        "text",
        "the Mooncake master (HOST:PORT) of a shared tier behind the local store (empty: off)",
        "",
    )
    metadata: str = _setting(
        "text", "the Mooncake metadata server (a URL like http://HOST:PORT/metadata)", ""
    )
    local_hostname: str = _setting(
        "text", "this node's address as the shared tier's transfer engine sees it", "127.0.0.1"
    )
    segment_bytes: int = _setting(
        "size",
        "memory this node lends to the shared tier (0: none, else at least 16MiB)",
        256 * MiB,
        low=0,
        high=1 * TiB,
    )
    timeout_s: float = _setting(
        "seconds", "time a shared-tier call may take", 2.0, low=0.01, high=600.0, deprecated=FIXED
    )
    client: str = _setting(
        "choice",
        "where the shared tier's client runs",
        "process",
        choices=("process", "inline"),
        deprecated=BENCH,
    )
    pending: int = _setting(
        "int", "blocks waiting to be published", 4096, low=1, high=1 << 20, deprecated=FIXED
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.master and not self.metadata:
            raise ConfigError("cluster_metadata: required with cluster_master (the metadata URL)")
        if 0 < self.segment_bytes < 16 * MiB:
            raise ConfigError("cluster_segment_bytes: must be 0 or at least 16MiB")


# The groups, each a TOML table and an attribute of Config, in --help's order.
GROUPS: dict[str, type[_Group]] = {
    "store": StoreSettings,
    "socket": SocketSettings,
    "tenants": TenantSettings,
    "limits": Limits,
    "metrics": MetricsSettings,
    "events": EventSettings,
    "cluster": ClusterSettings,
}


@dataclass(frozen=True)
class Config:
    """Everything `prefixd serve` can be told, in its groups."""

    store: StoreSettings
    socket: SocketSettings
    tenants: TenantSettings = field(default_factory=TenantSettings)
    limits: Limits = field(default_factory=Limits)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    events: EventSettings = field(default_factory=EventSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)

    def __post_init__(self) -> None:
        self.store_config()  # the checks StoreConfig makes across fields
        for group, members in self.tenants.share_groups.items():
            for tenant in sorted(self.events.tenants & set(members)):
                raise ConfigError(
                    f"kv_events_tenants: {tenant!r} stores its entries in share group {group!r}, "
                    f"as tenant {SHARE_PREFIX + group!r}: name that (it publishes every member's)"
                )

    @classmethod
    def from_settings(cls, **values: Any) -> Config:
        """A Config from settings by their flat names (data_dir=..., socket_mode=0o600)."""
        unknown = sorted(set(values) - set(WHERE))
        if unknown:
            raise ConfigError(f"unknown setting(s) {', '.join(unknown)}")
        groups: dict[str, dict[str, Any]] = {table: {} for table in GROUPS}
        for name, value in values.items():
            table, key = WHERE[name]
            groups[table][key] = value
        made = {table: GROUPS[table](**given) for table, given in groups.items()}
        return cls(**made)  # type: ignore[arg-type]

    def with_settings(self, **values: Any) -> Config:
        """This Config with the settings `values` (by flat name) changed."""
        groups: dict[str, dict[str, Any]] = {}
        for name, value in values.items():
            table, key = WHERE[name]
            groups.setdefault(table, {})[key] = value
        return dataclasses.replace(
            self, **{t: dataclasses.replace(getattr(self, t), **kw) for t, kw in groups.items()}
        )

    def value(self, name: str) -> Any:
        """A setting by its flat name."""
        table, key = WHERE[name]
        return getattr(getattr(self, table), key)

    def store_config(self) -> StoreConfig:
        """The store's settings: data_dir as the path, created on first start."""
        values = {name: self.value(name) for name in STORE_SETTINGS}
        return StoreConfig(path=self.store.data_dir, create=True, **values)

    def describe(self) -> dict[str, Any]:
        """The effective settings as JSON-able values; written as TOML, they load back unchanged."""
        return {name: plain(name, self.value(name)) for name in SETTINGS}

    def toml(self) -> str:
        """The effective settings as a TOML file `--config` accepts, a table per group, each
        setting with its help; a deprecated one only where it is not its default."""
        described = self.describe()
        lines = []
        for table, names in TABLES.items():
            lines.append(f"[{table}]")
            for name in names:
                if name in DEPRECATED and self.value(name) == DEFAULTS[name]:
                    continue
                lines.append(f"# {META[name]['help']}")
                lines.append(f"{toml_key(name)} = {toml_value(described[name])}")
            lines.append("")
        return "\n".join(lines)


def flat_name(group: type[_Group], item: Any) -> str:
    """The name of a group's field as flags, variables and messages write it."""
    return str(item.metadata["name"] or group.prefix + item.name)


WHERE: dict[str, tuple[str, str]] = {
    flat_name(group, item): (table, item.name)
    for table, group in GROUPS.items()
    for item in fields(group)  # type: ignore[arg-type]
}
SETTINGS: tuple[str, ...] = tuple(WHERE)
META: dict[str, Mapping[str, Any]] = {
    flat_name(group, item): item.metadata
    for group in GROUPS.values()
    for item in fields(group)  # type: ignore[arg-type]
}
DEFAULTS = {
    flat_name(group, item): _default(item)
    for group in GROUPS.values()
    for item in fields(group)  # type: ignore[arg-type]
}
TABLES: dict[str, tuple[str, ...]] = {
    table: tuple(name for name, (t, _) in WHERE.items() if t == table) for table in GROUPS
}
DEPRECATED: dict[str, str] = {name: m["deprecated"] for name, m in META.items() if m["deprecated"]}
STORE_SETTINGS: tuple[str, ...] = tuple(
    f.name for f in fields(StoreConfig) if f.name not in ("path", "create")
)


def toml_key(name: str) -> str:
    """The key of a setting in its table: cluster_master -> master, socket -> path."""
    return WHERE[name][1]


def toml_name(name: str) -> str:
    """The setting as a TOML file names it, for messages: [cluster] master."""
    return f"[{WHERE[name][0]}] {toml_key(name)}"


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
    if name in STORE_SETTINGS:  # alone: the checks across fields wait for Config.store_config
        alone: dict[str, Any] = {"map_size": StoreConfig.map_size_max, name: value}
        return getattr(StoreConfig(path=Path("."), **alone), name)
    meta = META[name]
    if meta["optional"] and value in (None, ""):
        return None  # an optional path left empty: the feature is off
    if name in _MAPS and isinstance(value, Mapping):
        value = _MAPS[name][1](value)  # parsed already: checked again as its entries
    value = typed(name, value, meta)
    if value and name in _CHECKS:
        try:
            _CHECKS[name](value)
        except ConfigError:
            raise  # it names the setting itself (and is a ValueError too)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
    if name in _MAPS:
        try:
            value = _MAPS[name][0](value)
        except ValueError as exc:
            raise ConfigError(f"{name}: {exc}") from None
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


def _event_endpoint(endpoint: str) -> None:
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if host in ("127.0.0.1", "localhost", "[::1]") and port.isdigit() and 0 < int(port) < 65536:
            return
    raise ValueError(
        "must be ipc://PATH or tcp://127.0.0.1:PORT (a loopback address: events carry prompt "
        "token ids)"
    )


# What a setting needs besides its kind's checks, for a value given (not empty): a ValueError is
# named after the setting, a ConfigError says it all.
_CHECKS: dict[str, Callable[[Any], object]] = {
    "socket": _short_socket,
    "metrics_textfile": _prom_file,
    "tenant_policy": lambda entries: TenantPolicy(entries, os.geteuid()),
    "instance": check_instance,
    "daemon_user": _known_user,
    "kv_events_endpoint": _event_endpoint,
    "kv_events_replay_endpoint": _event_endpoint,
}


def plain(name: str, value: Any) -> Any:
    """A setting as a JSON/TOML-able value that parses back to the same setting."""
    if name in STORE_SETTINGS and isinstance(value, Mapping):
        return tenant_entries(name, value)
    if name in _MAPS and isinstance(value, Mapping):
        return list(_MAPS[name][1](value))
    if isinstance(value, Path):
        return str(value)
    if value is None:
        return ""  # an optional path that is off
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, frozenset):
        return ",".join(sorted(value))
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


def _manifest_entries(models: Mapping[str, tuple[Path, ...]]) -> tuple[str, ...]:
    return tuple(f"{model}={'+'.join(map(str, files))}" for model, files in models.items())


# Settings held as maps (besides the store's): (parse entries, write the map as entries).
_MAPS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], tuple[str, ...]]]] = {
    "model_manifests": (parse_manifests, _manifest_entries),
}
