"""`PrefixdOffloadingSpec`: prefixd as vLLM's whole offloading spec, without vLLM's CPU tier.

Loaded by vLLM's OffloadingConnector through `spec_module_path` (`kv_transfer_config(...,
direct=True)` writes the settings). The scheduler side (manager.py) answers lookups and plans
loads and stores against the daemon; the worker side (worker.py) moves chunks between the KV cache
and prefixd's shared regions itself: a hit travels LMDB -> verified into the region -> KV cache,
a store KV cache -> region -> LMDB. `PrefixdTier` stays for nodes that want vLLM's CPU tier in
front.

Settings (`kv_connector_extra_config`, beside `spec_name` and `spec_module_path`): `socket`,
`identity` (engine_fields), `tenant`, `region_bytes` (the scheduler's region: payloads verified
for hits until they are loaded), `store_region_bytes` (each worker's, for stores), `timeout_s`,
`reconnect_s`, `daemon_uid`, `prefill_tokens_per_s` (the benefit rule's prefill rate) and
`enable_kv_events`.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from prefixd.integrations.vllm.jobs import PrefixdLoadSpec, PrefixdStoreSpec
from prefixd.integrations.vllm.manager import PrefixdManager
from prefixd.integrations.vllm.settings import Settings, rank_identities
from prefixd.integrations.vllm.worker import PrefixdWorker


class PrefixdOffloadingSpec(OffloadingSpec):  # type: ignore[misc]
    """vLLM's offloading spec with prefixd as the only tier."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if config.canonical_layout:
            raise ValueError(
                "PrefixdOffloadingSpec stores the direct layout: drop canonical_layout"
            )
        self.settings = Settings.of(self.extra_config)
        self.identities = rank_identities(config, self.settings)
        self._manager: OffloadingManager | None = None
        self._worker: OffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            events = self.kv_events_config.enable_kv_cache_events
            self._manager = PrefixdManager(self.config, self.settings, self.identities, events)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = PrefixdWorker(self.config, self.settings, self.identities, kv_caches)
        return self._worker


__all__ = ["PrefixdLoadSpec", "PrefixdOffloadingSpec", "PrefixdStoreSpec", "Settings"]
