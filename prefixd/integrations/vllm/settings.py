"""The direct spec's settings, read once from vLLM's `kv_connector_extra_config`, and the
identities they give each worker rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.v1.kv_offload.config import OffloadingConfig

from prefixd.integrations.link import DaemonLink
from prefixd.integrations.vllm.identity import group_identities
from prefixd.schema.identity import Identity

DEFAULT_REGION_BYTES = 256 << 20
DEFAULT_STORE_REGION_BYTES = 64 << 20


@dataclass(frozen=True)
class Settings:
    """The spec's settings, read once from `kv_connector_extra_config`."""

    socket: str
    fields: dict[str, str | None]
    tenant: str = "default"
    region_bytes: int = DEFAULT_REGION_BYTES
    store_region_bytes: int = DEFAULT_STORE_REGION_BYTES
    timeout_s: float = 2.0
    reconnect_s: float = 1.0
    daemon_uid: int | str | None = None
    prefill_tokens_per_s: float | None = None
    enable_kv_events: bool = False

    def link(self, name: str, label: str, region_bytes: int) -> DaemonLink:
        """A connection to the daemon (the scheduler's, `region_bytes` for held hits; a
        worker's, for its stores)."""
        return DaemonLink(
            self.socket,
            region_bytes=region_bytes,
            timeout_s=self.timeout_s,
            name=name,
            label=label,
            reconnect_s=self.reconnect_s,
            daemon_uid=self.daemon_uid,
        )

    @classmethod
    def of(cls, extra: Any) -> Settings:
        if "socket" not in extra or "identity" not in extra:
            raise ValueError(
                "PrefixdOffloadingSpec needs 'socket' and 'identity' in kv_connector_extra_config: "
                "write it with prefixd.integrations.vllm.kv_transfer_config(..., direct=True)"
            )
        return cls(
            socket=str(extra["socket"]),
            fields=dict(extra["identity"]),
            tenant=str(extra.get("tenant", "default")),
            region_bytes=int(extra.get("region_bytes", DEFAULT_REGION_BYTES)),
            store_region_bytes=int(extra.get("store_region_bytes", DEFAULT_STORE_REGION_BYTES)),
            timeout_s=float(extra.get("timeout_s", 2.0)),
            reconnect_s=float(extra.get("reconnect_s", 1.0)),
            daemon_uid=extra.get("daemon_uid"),
            prefill_tokens_per_s=extra.get("prefill_tokens_per_s"),
            enable_kv_events=bool(extra.get("enable_kv_events", False)),
        )


def rank_identities(config: OffloadingConfig, settings: Settings) -> list[dict[int, Identity]]:
    """Each worker rank's identities by group: a rank holds its own share of every block."""
    return [
        group_identities(config, settings.fields, settings.tenant, f"direct rank={rank}")
        for rank in range(config.parallel.world_size)
    ]


__all__ = ["DEFAULT_REGION_BYTES", "DEFAULT_STORE_REGION_BYTES", "Settings", "rank_identities"]
