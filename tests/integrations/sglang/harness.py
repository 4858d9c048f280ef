"""SGLang's own storage code around a backend: real CPU host pools, the factory, the controller.

The engine does not start on this CPU machine (it needs sgl_kernel's CUDA build), so the
controller is not constructed by its `__init__` (which needs the engine's process groups and
device pools); `Controller` is a HiCacheController made with `__new__` and given the attributes
its storage methods read, then attached as `attach_storage_backend` attaches: the factory's
`create_backend`, `register_mem_pool_host`, `on_host_pools_registered`, and the same choice of
page get/set functions (interface_v1). Its hit query, backup and prefetch transfer are SGLang's
own methods, run unchanged.
"""

from __future__ import annotations

import queue
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from sglang.srt.managers.cache_controller import (
    HiCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

from prefixd.integrations.sglang import extra_config

PAGE = 16  # tokens per page
LAYERS, HEADS, HEAD_DIM = 3, 2, 32
DTYPE = torch.bfloat16
MAMBA_LAYERS = 2


def host_pool(layout: str, *, layers: int = LAYERS, tokens: int = 1024) -> MHATokenToKVPoolHost:
    """A real CPU device pool and the host pool HiCache keeps in front of it."""
    device = MHATokenToKVPool(
        tokens, PAGE, DTYPE, HEADS, HEAD_DIM, layers, "cpu", False, start_layer=0, end_layer=layers
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        2,
        0,
        PAGE,
        layout,
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
        write_back_staging=device.hicache_write_back_staging,
    )


def mamba_pool(
    *,
    ssm_dtype: torch.dtype = torch.float32,
    ssm_shape: tuple[int, ...] = (4, 16, 16),
    slots: int = 8,
) -> MambaPoolHost:
    """A real CPU Mamba host pool (page_first, one state per slot) over the checkpoint tensors a
    device Mamba pool hands HiCache: SSM (temporal) and conv states of every Mamba layer."""
    info = MambaStateBufferInfo(
        temporal=torch.zeros(MAMBA_LAYERS, slots, *ssm_shape, dtype=ssm_dtype),
        conv=(torch.zeros(MAMBA_LAYERS, slots, 64, 3, dtype=DTYPE),),
    )
    return MambaPoolHost(info, 2.0, 0, device_capacity=slots, pin_memory=False, layout="page_first")


def storage_config(
    extra: dict[str, Any],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layout: str = "layer_first",
    model: str = "tiny-model",
    mla: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=mla,
        enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first",
        model_name=model,
        extra_config=extra,
    )


def prefixd_extra(socket: Path | str, **options: Any) -> dict[str, Any]:
    options.setdefault("weights", "rev=test-weights")
    return extra_config(socket=str(socket), **options)


def file_extra(path: Path, **options: Any) -> dict[str, Any]:
    """SGLang's own file backend, loaded through the same dynamic path."""
    return {
        "backend_name": "file",
        "module_path": "sglang.srt.mem_cache.hicache_storage",
        "class_name": "HiCacheFile",
        "file_storage_path": str(path),
        **options,
    }


def attach_pools(extra: dict[str, Any], pools: Mapping[str, Any], **ranks: Any) -> HiCacheStorage:
    """A backend created and registered as the hybrid controller's attach does it: the "kv"
    pool as its anchor, then every pool of the set by name (v2); `ranks`: the storage config's
    tp_rank, tp_size, ..."""
    config = storage_config(extra, **ranks)
    backend = StorageBackendFactory.create_backend("dynamic", config, pools["kv"])
    backend.register_mem_pool_host(pools["kv"])
    for name, pool in pools.items():
        backend.register_mem_host_pool_v2(pool, name)
    backend.on_host_pools_registered()
    return backend


class Controller:
    """SGLang's HiCacheController storage methods over one host pool and one backend."""

    def __init__(self, pool: MHATokenToKVPoolHost, extra: dict[str, Any], **config: Any) -> None:
        controller = HiCacheController.__new__(HiCacheController)
        controller.mem_pool_host = controller.storage_host_pool = pool
        controller.page_size = pool.page_size
        controller.storage_backend_type = "dynamic"
        controller.storage_config = storage_config(dict(extra), layout=pool.layout, **config)
        # as attach_storage_backend does it
        backend = StorageBackendFactory.create_backend("dynamic", controller.storage_config, pool)
        backend.register_mem_pool_host(pool)
        backend.on_host_pools_registered()
        controller.storage_backend = backend
        controller.page_get_func = controller._generic_page_get
        controller.page_set_func = controller._generic_page_set
        if bool(controller.storage_config.extra_config.get("interface_v1", 0)):
            controller.page_get_func = controller._page_get_zero_copy
            controller.page_set_func = controller._page_set_zero_copy
        controller.prefetch_sync_queue = queue.Queue()
        self.controller = controller
        self.pool = pool
        self.backend = backend

    def backup(
        self, tokens: list[int], host_indices: torch.Tensor, *, prefix: list[str] | None = None
    ) -> int:
        """The controller's backup of `tokens`' pages from `host_indices`; tokens stored."""
        hashes = page_hashes(tokens, prefix)
        operation = StorageOperation(
            host_indices, tokens, hash_value=hashes, prefix_keys=list(prefix or [])
        )
        self.controller._page_backup(operation)
        return int(operation.completed_tokens)

    def hit(self, tokens: list[int], *, prefix: list[str] | None = None) -> int:
        """The controller's hit query: tokens of `tokens` found in storage."""
        operation = PrefetchOperation(
            "req", tokens, last_hash=(prefix or [None])[-1], prefix_keys=list(prefix or [])
        )
        _, hit_tokens = self.controller._storage_hit_query(operation)
        return int(hit_tokens)

    def prefetch(
        self, tokens: list[int], host_indices: torch.Tensor, *, prefix: list[str] | None = None
    ) -> int:
        """The controller's hit query, then its page transfer into `host_indices`: tokens read."""
        operation = PrefetchOperation(
            "req", tokens, last_hash=(prefix or [None])[-1], prefix_keys=list(prefix or [])
        )
        hashes, hit_tokens = self.controller._storage_hit_query(operation)
        operation.hash_value = hashes
        operation.host_indices = host_indices[:hit_tokens]
        return int(self.controller._page_transfer(operation)) * self.pool.page_size

    def close(self) -> None:
        if hasattr(self.backend, "close"):
            self.backend.close()


def page_hashes(tokens: list[int], prefix: list[str] | None = None) -> list[str]:
    """SGLang's page hashes of `tokens`, chained on after `prefix` (the pages before them)."""
    last = prefix[-1] if prefix else None
    return list(get_storage_hash_str(tokens, last, page_size=PAGE))


def fill(pool: MHATokenToKVPoolHost, indices: torch.Tensor, seed: int) -> None:
    """Seeded random KV in the host slots `indices` (every layer, K and V)."""
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, indices.numel(), pool.page_size):
        page = pool.get_data_page(int(indices[start]), flat=False)
        page.copy_(torch.randn(page.shape, generator=generator).to(page.dtype))


def pages_of(pool: MHATokenToKVPoolHost, indices: torch.Tensor) -> list[bytes]:
    """The flat bytes of each page at `indices`, as SGLang's get_data_page gives them."""
    return [
        pool.get_data_page(int(indices[s]), flat=True)
        .contiguous()
        .view(torch.uint8)
        .numpy()
        .tobytes()
        for s in range(0, indices.numel(), pool.page_size)
    ]
