"""Typed settings of one store. The daemon's Config embeds these one to one."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from enum import Enum
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from prefixd.errors import ConfigError
from prefixd.store.fair import default_threads

T = TypeVar("T", int, float)

GiB = 1 << 30
MiB = 1 << 20


class Durability(str, Enum):
    """What an acknowledged put survives. See README "Durability" for the exact contract.

    FULL: every put is fsynced before it returns; survives power loss.
    PERIODIC: puts reach the OS at commit (a killed process loses nothing acknowledged); a background
    sync runs every `sync_interval_s`, so an OS crash or power loss can lose the puts of the last
    interval. Checksums keep a torn block from ever being served.
    """

    FULL = "full"
    PERIODIC = "periodic"


COMPRESSIONS = ("none", "zstd", "zstd-planes")
READ_PATHS = ("auto", "mmap", "pread")  # how loads read raw payloads: prefixd.store.direct
_SECONDS_UNITS = {"": 1.0, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SECONDS_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*")


def parse_seconds(text: str) -> float:
    """A duration: a number of seconds, or one ending in ms, s, m, h or d ("90m", "30d"); a
    finite one (nan, inf and 1e400 are no durations)."""
    try:
        seconds = float(text)
    except ValueError:
        match = _SECONDS_RE.fullmatch(text)
        if match is None:
            raise ValueError(text) from None
        seconds = float(match[1]) * _SECONDS_UNITS[match[2] or ""]
    if not math.isfinite(seconds):
        raise ValueError(text)
    return seconds


_SIZE_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?)\s*([kmgt]ib|b)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'16MiB' -> 16777216; plain integers are bytes. Decimal units (MB) are refused: ambiguous."""
    try:
        return int(text)
    except ValueError:
        pass
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ValueError(text)
    try:
        exact = Decimal(match[1]) * _SIZE_UNITS[(match[2] or "").lower()]
    except InvalidOperation:
        raise ValueError(text) from None
    if exact != exact.to_integral_value():
        raise ValueError(text)
    return int(exact)


def format_size(n: int) -> str:
    """16777216 -> '16MiB': the largest unit that divides n exactly."""
    for unit in ("tib", "gib", "mib", "kib"):
        factor = _SIZE_UNITS[unit]
        if n and n % factor == 0:
            return f"{n // factor}{unit[0].upper()}iB"
    return str(n)


def format_seconds(seconds: float) -> str:
    """5400.0 -> '90m': the largest unit that divides the duration exactly."""
    for unit in ("d", "h", "m", "s"):
        count = seconds / _SECONDS_UNITS[unit]
        if count == int(count):
            return f"{int(count)}{unit}"
    return f"{seconds!r}s"


def _per_tenant(entries: tuple[str, ...], parse: Callable[[str], T], shape: str) -> dict[str, T]:
    """{tenant: value} from TENANT=VALUE entries, each value positive, each tenant once."""
    values: dict[str, T] = {}
    for entry in entries:
        tenant, sep, text = entry.partition("=")
        try:
            value = parse(text) if sep and tenant else None
        except ValueError:
            value = None
        if value is None or value <= 0 or tenant in values:
            raise ValueError(f"{entry!r} is not TENANT={shape}")
        values[tenant] = value
    return values


def _share_entry(group: str, tenants: tuple[str, ...]) -> str:
    return f"{group}={'+'.join(tenants)}"


SHARE_PREFIX = "share:"  # the tenant name a share group's entries are stored under


def parse_share_groups(entries: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """{group: tenants} from GROUP=TENANT+TENANT[+...] entries; a tenant is in one group at most."""
    groups: dict[str, tuple[str, ...]] = {}
    seen: set[str] = set()
    for entry in entries:
        group, sep, members = entry.partition("=")
        tenants = tuple(t for t in members.split("+") if t)
        if not sep or not group or len(tenants) < 2 or group in groups:
            raise ValueError(f"{entry!r} is not GROUP=TENANT+TENANT[+...] (two tenants or more)")
        if seen & set(tenants) or any(t.startswith(SHARE_PREFIX) for t in tenants):
            raise ValueError(f"{entry!r}: a tenant may be in one share group only")
        seen.update(tenants)
        groups[group] = tenants
    return groups


# The per-tenant settings, each written as TENANT=VALUE entries and held as a map: (parse the
# entries, write one entry of the map); ValueError says which entry is wrong.
TENANT_MAPS: dict[str, tuple[Callable[[tuple[str, ...]], Any], Callable[[str, Any], str]]] = {
    "tenant_quotas": (
        partial(_per_tenant, parse=parse_size, shape="SIZE (a positive size, once each)"),
        lambda tenant, size: f"{tenant}={format_size(size)}",
    ),
    "tenant_ttls": (
        partial(
            _per_tenant, parse=parse_seconds, shape="DURATION (a positive duration, once each)"
        ),
        lambda tenant, seconds: f"{tenant}={format_seconds(seconds)}",
    ),
    "share_groups": (parse_share_groups, _share_entry),
}


def tenant_entries(name: str, values: Mapping[str, Any]) -> list[str]:
    """A per-tenant map as the entries a file or a flag writes."""
    return [TENANT_MAPS[name][1](key, value) for key, value in values.items()]


@dataclass(frozen=True)
class StoreConfig:
    """Settings of one store; every field is validated on construction."""

    path: Path
    create: bool = True
    map_size: int = 64 * GiB
    durability: Durability = Durability.PERIODIC
    sync_interval_s: float = 1.0
    compression: str = "none"
    zstd_level: int = 1
    min_compression_gain: float = 0.05
    chunk_bytes: int = 1 * MiB
    # threads copying and verifying the payloads of every load (prefixd.store.fair), and
    # encoding puts': about one per usable core, at least 2; 0: each caller's own thread alone
    verify_threads: int = default_threads()
    readahead: bool = True
    read_path: str = "auto"
    max_readers: int = 256
    verified_cache_bytes: int = 32 * MiB
    capacity_bytes: int = 0
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    eviction: str = "value"
    tenant_quota_bytes: int = 0
    # TENANT=VALUE entries or a map; held as a map ("*" in the quotas: each tenant not listed)
    tenant_quotas: Mapping[str, int] = field(default_factory=dict)
    tenant_ttls: Mapping[str, float] = field(default_factory=dict)
    share_groups: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # clear the store's files after retiring a model's versions and reclaiming expired entries too,
    # as a tenant's purge always does (prefixd.store.scrub)
    scrub_retired: bool = False

    map_size_max: ClassVar[int] = 1 << 50

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ConfigError("path: must be a directory path")
        object.__setattr__(self, "path", Path(self.path))
        try:
            object.__setattr__(self, "durability", Durability(self.durability))
        except ValueError:
            choices = ", ".join(d.value for d in Durability)
            raise ConfigError(
                f"durability: must be one of {choices}, got {self.durability!r}"
            ) from None
        if self.compression not in COMPRESSIONS:
            raise ConfigError(
                f"compression: must be one of {', '.join(COMPRESSIONS)}, got {self.compression!r}"
            )
        if self.read_path not in READ_PATHS:
            raise ConfigError(
                f"read_path: must be one of {', '.join(READ_PATHS)}, got {self.read_path!r}"
            )
        _int_in("map_size", self.map_size, 1 * MiB, self.map_size_max)
        _int_in("zstd_level", self.zstd_level, -7, 22)
        _int_in("chunk_bytes", self.chunk_bytes, 64 << 10, 1 << 30)
        if self.chunk_bytes % 2:
            raise ConfigError("chunk_bytes: must be even (zstd-planes splits 2-byte values)")
        _int_in("verify_threads", self.verify_threads, 0, 64)
        _int_in("max_readers", self.max_readers, 1, 1 << 16)
        _int_in("verified_cache_bytes", self.verified_cache_bytes, 0, 1 << 40)
        _int_in("capacity_bytes", self.capacity_bytes, 0, self.map_size)
        _int_in("tenant_quota_bytes", self.tenant_quota_bytes, 0, self.map_size)
        for name, shape in (
            ("tenant_ttls", "TENANT=DURATION"),
            ("tenant_quotas", "TENANT=SIZE"),
            ("share_groups", "GROUP=TENANT+TENANT"),
        ):
            object.__setattr__(self, name, _tenant_map(name, getattr(self, name), shape))
        star = self.tenant_quotas.get("*")
        if self.tenant_quota_bytes and star is not None and star != self.tenant_quota_bytes:
            raise ConfigError(
                f"tenant_quota_bytes ({self.tenant_quota_bytes}) and tenant_quotas *={star} name "
                "two default quotas: give one"
            )
        _number_in("high_watermark", self.high_watermark, 0.05, 1.0)
        _number_in("low_watermark", self.low_watermark, 0.0, self.high_watermark)
        if self.eviction not in ("value", "lru", "none"):
            raise ConfigError(f"eviction: must be value, lru or none, got {self.eviction!r}")
        _number_in("sync_interval_s", self.sync_interval_s, 0.01, 3600.0)
        _number_in("min_compression_gain", self.min_compression_gain, 0.0, 0.99)
        for flag in ("create", "readahead", "scrub_retired"):
            if not isinstance(getattr(self, flag), bool):
                raise ConfigError(f"{flag}: must be true or false")

    @property
    def default_quota(self) -> int:
        """The quota of a tenant the quotas do not name (0: none)."""
        return self.tenant_quotas.get("*", self.tenant_quota_bytes)


def _tenant_map(name: str, value: object, shape: str) -> dict[str, Any]:
    """A per-tenant setting as a map, from entries or a map (checked again as its entries)."""
    if isinstance(value, Mapping):
        value = tenant_entries(name, value)
    if not isinstance(value, (list, tuple)) or not all(isinstance(e, str) for e in value):
        raise ConfigError(f"{name}: must be a list of {shape}")
    try:
        parsed: dict[str, Any] = TENANT_MAPS[name][0](tuple(value))
    except ValueError as exc:
        raise ConfigError(f"{name}: {exc}") from None
    return parsed


def _int_in(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ConfigError(f"{name}: must be in [{low}, {high}], got {value}")


def _number_in(name: str, value: object, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name}: must be a number, got {type(value).__name__}")
    if not low <= value <= high:
        raise ConfigError(f"{name}: must be in [{low}, {high}], got {value}")
