"""Test-only offloading spec: vLLM's stock TieringOffloadingSpec with a CPU copy in its worker.

vLLM's `TieringOffloadingSpec` (vllm/v1/kv_offload/tiering/spec.py) refuses the CPU platform: its
`get_worker` (inherited from `CPUOffloadingSpec`) raises "CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs", and the worker it builds (`CPUOffloadingWorker`) copies KV blocks with
CUDA streams, events and the `swap_blocks_batch` kernel. On a CPU engine the model's KV cache is
already host memory, so that one copy is all that stands in the way.

`CPUTieringOffloadingSpec` replaces exactly that: `get_worker` drops the platform check and
`create_worker` returns `SyncCopyWorker`, which copies between the model's KV tensors and the rows
of the primary (CPU) tier synchronously with tensor indexing, and reports each job finished on the
next `get_finished()`. The worker sees the same mmap-backed rows as the stock worker (a
`SharedOffloadRegion` over /dev/shm opened by rank, each tensor's pages laid out with
`create_next_worker_view`) and the same block/chunk arithmetic (`blocks_per_chunk` GPU blocks per
chunk, a group's first chunk entered at `block_indices[g] % blocks_per_chunk`, `page_size_bytes` of
each layer reference copied per block). Everything else is stock vLLM, unchanged: the
OffloadingConnector's scheduler and worker halves, the tiering manager, the CPU primary tier and its
eviction policy, the secondary tiers and the config keys they read. Only the default (direct) layout
is supported, not `canonical_layout`.

Load it with
`kv_connector_extra_config={"spec_name": "CPUTieringOffloadingSpec",
"spec_module_path": "tests.integrations.vllm.cpu_spec", "cpu_bytes_to_use": ..., ...}`.
Runs only in the vLLM venv.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec


class SyncCopyWorker(OffloadingWorker):
    """Copies KV blocks between the model's KV tensors and primary-tier rows, synchronously."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
    ) -> None:
        self._region: SharedOffloadRegion | None = region
        self._blocks_per_chunk = blocks_per_chunk
        self._group_refs = kv_caches.group_data_refs
        # Per tensor: the model's blocks (num_blocks, page) and the tier's rows split into
        # sub-blocks (num_chunks, blocks_per_chunk, page): int8 views, as the stock worker's.
        self._blocks: list[torch.Tensor] = []
        self._rows: list[torch.Tensor] = []
        for kv in kv_caches.tensors:
            page = kv.page_size_bytes
            self._blocks.append(kv.tensor.view(torch.int8).view((-1, page)))
            rows = region.create_next_worker_view(page * blocks_per_chunk)
            self._rows.append(rows.view(rows.shape[0], blocks_per_chunk, page))
        self._finished: list[TransferResult] = []

    def _copy(self, job_id: int, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec, store: bool) -> bool:
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        start = time.perf_counter()
        nbytes = 0
        gpu_offset = cpu_offset = 0
        per = self._blocks_per_chunk
        for refs, size, first in zip(self._group_refs, gpu.group_sizes, gpu.block_indices):
            if size == 0:
                continue
            gpu_ids = gpu.block_ids[gpu_offset : gpu_offset + size]
            blocks = torch.from_numpy(gpu_ids.astype(np.int64))
            skip = first % per  # sub-blocks of the group's first chunk that lie before the group
            n_chunks = -(-(size + skip) // per)
            chunk_ids = cpu.block_ids[cpu_offset : cpu_offset + n_chunks].astype(np.int64)
            sub = np.arange(skip, skip + size)
            chunks = torch.from_numpy(chunk_ids[sub // per])
            subs = torch.from_numpy(sub % per)
            for ref in refs:
                model, rows = self._blocks[ref.tensor_idx], self._rows[ref.tensor_idx]
                n = ref.page_size_bytes  # the layer's unpadded bytes of each block
                if store:
                    rows[chunks, subs, :n] = model[blocks, :n]
                else:
                    model[blocks, :n] = rows[chunks, subs, :n]
                nbytes += size * n
            gpu_offset += size
            cpu_offset += n_chunks
        assert gpu_offset == len(gpu.block_ids) and cpu_offset == len(cpu.block_ids)
        self._finished.append(TransferResult(job_id, True, nbytes, time.perf_counter() - start))
        return True

    @override
    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    @override
    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    @override
    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    @override
    def wait(self, job_ids: set[int]) -> None:
        return  # every job is done when its submit returns

    @override
    def shutdown(self) -> None:
        self._blocks.clear()
        self._rows.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """TieringOffloadingSpec whose worker copies with `SyncCopyWorker` (so it runs on CPU)."""

    @override
    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # The stock one raises on the CPU platform before building its worker.
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    @override
    def create_worker(self, kv_caches: CanonicalKVCaches) -> SyncCopyWorker:
        if self.config.canonical_layout:
            raise ValueError("CPUTieringOffloadingSpec supports only the direct layout")
        # The same region the stock TieringOffloadingSpec.create_worker opens.
        region = SharedOffloadRegion(
            engine_id=self._engine_id,
            num_chunks=self.num_chunks,
            rank=0 if self.replicated_layout else self.config.parallel.rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return SyncCopyWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise
