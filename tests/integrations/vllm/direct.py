"""PrefixdOffloadingSpec driven as vLLM's OffloadingConnector drives it, without an engine: the
spec built from an OffloadingConfig, its manager called as the connector's scheduler side calls it,
its worker handed canonical KV caches (CPU tensors; on CUDA, device tensors) and the GPU block specs
the scheduler side builds. Used by test_spec.py and bench/vllm_direct.py. vLLM venv only."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from prefixd.integrations.vllm.spec import PrefixdOffloadingSpec

try:  # vLLM 0.34 on: the connector hands the worker device pointers, resolved so
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers
except ImportError:  # 0.32, 0.33: the GPULoadStoreSpec itself
    resolve_device_pointers = None

from .harness import FIELDS, TOKENS_PER_BLOCK, scheduler_lookup, settle

PER = 2  # blocks per chunk: a chunk's first block may lie before a load's first
PAGES = (1024, 512)  # two layers' page bytes per block
CHUNK_BYTES = PER * sum(PAGES)  # one chunk's payload
BLOCKS = 64  # KV cache blocks per layer


def direct_config(
    socket: str, *, pages: tuple[int, ...] = PAGES, events: bool = False, **settings: Any
) -> OffloadingConfig:
    """One group of len(pages) layers; a chunk of PER blocks spans TOKENS_PER_BLOCK tokens (the
    harness's keys' positions)."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                TOKENS_PER_BLOCK // PER, tuple(f"layer.{i}" for i in range(len(pages))), 0
            ),
        ),
        worker_kv_bytes_per_block=sum(pages),
        enable_kv_cache_events=events,
        extra_config={"socket": socket, "identity": FIELDS, **settings},
        engine_id=f"prefixd-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK // PER, blocks_per_chunk=PER),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


@dataclass
class Direct:
    """One engine's spec, manager and worker over its own KV cache (one tensor per layer)."""

    spec: PrefixdOffloadingSpec
    manager: Any
    worker: Any
    kv: list[torch.Tensor]
    caches: CanonicalKVCaches

    @classmethod
    def start(
        cls,
        socket: object,
        *,
        pages: tuple[int, ...] = PAGES,
        blocks: int = BLOCKS,
        device: str = "cpu",
        events: bool = False,
        **settings: Any,
    ) -> Direct:
        spec = PrefixdOffloadingSpec(
            direct_config(str(socket), pages=pages, events=events, **settings)
        )
        kv = [torch.zeros((blocks, page), dtype=torch.int8, device=device) for page in pages]
        caches = CanonicalKVCaches(
            tensors=[CanonicalKVCacheTensor(t, page) for t, page in zip(kv, pages, strict=True)],
            group_data_refs=[[CanonicalKVCacheRef(i, page) for i, page in enumerate(pages)]],
        )
        return cls(spec, spec.get_manager(), spec.get_worker(caches), kv, caches)

    def device(self, gpu: GPULoadStoreSpec) -> Any:
        """What the running release's connector hands the worker for `gpu`'s blocks."""
        return gpu if resolve_device_pointers is None else resolve_device_pointers(gpu, self.caches)

    _jobs = itertools.count(1)

    def fill(self, blocks: list[int], seed: int) -> list[bytes]:
        """Random bytes into `blocks` of every layer; each block's bytes, layers in order."""
        generator = torch.Generator().manual_seed(seed)
        for layer in self.kv:
            data = torch.randint(-128, 128, (len(blocks), layer.shape[1]), generator=generator)
            layer[torch.tensor(blocks)] = data.to(torch.int8).to(layer.device)
        return self.blocks(blocks)

    def blocks(self, blocks: list[int]) -> list[bytes]:
        """The bytes of `blocks`, every layer's in order."""
        return [b"".join(layer[b].cpu().numpy().tobytes() for layer in self.kv) for b in blocks]

    def store(self, ctx: ReqContext, keys: list[bytes], blocks: list[int]) -> list[bytes]:
        """A store job as the connector makes it: chunk i of `keys` from blocks[PER*i: PER*(i+1)].
        The keys the manager chose to store."""
        self.manager.on_new_request(ctx)
        prepared = self.manager.prepare_store(keys, ctx)
        assert prepared is not None
        chosen = [keys.index(k) for k in prepared.keys_to_store]
        ids = [blocks[PER * i + j] for i in chosen for j in range(PER)]
        first = PER * chosen[0] if chosen else 0
        gpu = GPULoadStoreSpec(ids, group_sizes=[len(ids)], block_indices=[first])
        self.run(lambda job: self.worker.submit_store(job, self.device(gpu), prepared.store_spec))
        self.manager.complete_store(prepared.keys_to_store, ctx)
        return list(prepared.keys_to_store)

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def lookup(self, ctx: ReqContext, keys: list[bytes]) -> int | None:
        return scheduler_lookup(self.manager, ctx, keys)

    def settle(self, ctx: ReqContext, keys: list[bytes], poll_s: float = 0.01) -> int:
        """Step (every `poll_s`, as vLLM's scheduler steps) until the lookup settles; the leading
        keys found."""
        return settle(self.manager, ctx, keys, self.step, poll_s)

    def load(self, ctx: ReqContext, keys: list[bytes], blocks: list[int], skip: int = 0) -> float:
        """Load `keys` (settled hits) into `blocks`, the first chunk's first `skip` blocks left
        out (held in the engine's own cache already); the job's seconds."""
        spec = self.manager.prepare_load(keys, ctx)
        gpu = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[skip])
        result = self.run(lambda job: self.worker.submit_load(job, spec, self.device(gpu)))
        self.manager.complete_load(keys, ctx)
        return result

    def run(self, submit: Any) -> float:
        job = next(self._jobs)
        assert submit(job)
        self.worker.wait({job})
        [result] = self.worker.get_finished()
        assert result.job_id == job and result.success
        return float(result.transfer_time)

    def held(self) -> tuple[int, int]:
        """Chunks the manager holds for hits, and the region bytes leased."""
        status = self.manager.status()
        return status["held_chunks"], status["region_leased_bytes"]

    def close(self) -> None:
        self.manager.shutdown()
        self.worker.shutdown()


def load_elsewhere(socket: str, spec: Any, blocks: list[int]) -> list[bytes]:
    """A worker in a process of its own, as with vLLM's multiprocess executor: it loads `spec`
    (made by another process's manager, pickled as vLLM sends it) into `blocks`; their bytes."""
    engine = Direct.start(socket)
    try:
        gpu = GPULoadStoreSpec(blocks, group_sizes=[len(blocks)], block_indices=[0])
        engine.run(lambda job: engine.worker.submit_load(job, spec, engine.device(gpu)))
        return engine.blocks(blocks)
    finally:
        engine.close()


__all__ = ["BLOCKS", "CHUNK_BYTES", "PAGES", "PER", "Direct", "direct_config", "load_elsewhere"]
