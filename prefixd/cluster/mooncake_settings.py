"""The shared tier's settings, checked when they are made (prefixd.cluster.mooncake)."""

from __future__ import annotations

from dataclasses import dataclass

from prefixd.errors import ConfigError

MIN_SEGMENT_BYTES = 16 << 20
"""Smallest non-zero segment Mooncake's `setup` accepted (8 MiB is refused with -600)."""


@dataclass(frozen=True)
class MooncakeSettings:
    """Where the Mooncake cluster is and what this process lends to it: `master` (host:port),
    `metadata` (the master's HTTP metadata server), `segment_bytes` lent to the pool (0, or at least
    16 MiB), `buffer_bytes` of staging (bounds values on non-TCP protocols). Calls give up after
    `timeout_s`; after an unavailable tier they fail at once for `cooldown_s`; `workers` bounds how
    many can hang at once."""

    master: str = "127.0.0.1:50051"
    metadata: str = "http://127.0.0.1:8080/metadata"
    local_hostname: str = "127.0.0.1"
    segment_bytes: int = 1 << 30
    buffer_bytes: int = 64 << 20
    protocol: str = "tcp"
    device: str = ""
    timeout_s: float = 5.0
    cooldown_s: float = 1.0
    workers: int = 4

    def __post_init__(self) -> None:
        host, _, port = self.master.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"mooncake master {self.master!r} is not host:port")
        if not self.metadata:
            raise ConfigError("mooncake metadata server URL is empty")
        if not self.local_hostname:
            raise ConfigError("mooncake local_hostname is empty")
        if self.segment_bytes != 0 and self.segment_bytes < MIN_SEGMENT_BYTES:
            raise ConfigError(
                f"mooncake segment_bytes={self.segment_bytes}: use 0 or at least "
                f"{MIN_SEGMENT_BYTES} (16 MiB)"
            )
        if self.buffer_bytes < 0:
            raise ConfigError(f"mooncake buffer_bytes={self.buffer_bytes} is negative")
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"mooncake protocol {self.protocol!r}: use 'tcp' or 'rdma'")
        if not self.timeout_s > 0:
            raise ConfigError(f"mooncake timeout_s={self.timeout_s} must be positive")
        if not self.cooldown_s >= 0:
            raise ConfigError(f"mooncake cooldown_s={self.cooldown_s} must be >= 0")
        if self.workers < 1:
            raise ConfigError(f"mooncake workers={self.workers} must be at least 1")

    @property
    def longest_call_s(self) -> float:
        """The longest one SharedTier call takes: a connect (two probes of at most 1 s, then
        `setup`) and the call itself."""
        return 2 * min(1.0, self.timeout_s) + 2 * self.timeout_s

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.master.rpartition(":")
        return host.strip("[]"), int(port)
