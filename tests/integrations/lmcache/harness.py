"""Driving an L2 adapter the way LMCache's controllers do: submit a task, wait on its event fd,
collect its result once. Test-only."""

from __future__ import annotations

import time
from typing import Any

import torch
from lmcache.cli.commands.bench.l2_adapter_bench.data import wait_eventfd
from lmcache.integration.vllm.vllm_multi_process_adapter import ParallelStrategy
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey, ipc_key_to_object_keys
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

from prefixd.integrations.lmcache import l2_adapter_config

DEADLINE_S = 60.0
MODEL = "tiny/llama"


def adapter_params(socket: object, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = l2_adapter_config(str(socket), weights="sha256:test", **extra)[
        "adapter_params"
    ]
    return params


def keys(count: int, *, start: int = 0, salt: str = "", rank: int = 0) -> list[ObjectKey]:
    return [
        ObjectKey(
            chunk_hash=(start + i).to_bytes(4, "big") * 8,
            model_name=MODEL,
            kv_rank=rank,
            object_group_id=0,
            cache_salt=salt,
        )
        for i in range(count)
    ]


def workers(*, tp: int, pp: int = 1, mla: bool = False) -> list[ParallelStrategy]:
    """Each worker of one vLLM engine as LMCache's vLLM adapter describes it (its KV world size
    and KV rank: `kv_world_size`, `kv_worker_id`)."""
    return [
        ParallelStrategy(
            mla_only=mla,
            vllm_world_size=tp * pp,
            vllm_worker_id=worker,
            tp_size=tp,
            pp_size=pp,
            n_servers=1,
        )
        for worker in range(tp * pp)
    ]


def rank_keys(hashes: list[bytes], world: int, worker: int | None) -> list[ObjectKey]:
    """The node server's ObjectKeys of chunk `hashes` for one KV rank's store (`worker`), or for
    a lookup (None: every rank's part, chunk by chunk), as `ipc_key_to_object_keys` makes them."""
    ipc_key = IPCCacheServerKey(
        model_name=MODEL,
        world_size=world,
        worker_id=worker,
        token_ids=(),
        start=0,
        end=0,
        request_id="r",
    )
    [found] = ipc_key_to_object_keys(ipc_key, hashes, [0])
    return list(found)


def memory_obj(size: int, fill: int | None = None) -> TensorMemoryObj:
    """A memory object of `size` bytes (one uint8 tensor), every byte `fill` when given."""
    obj = typed_obj(torch.Size([size]), torch.uint8)
    if fill is not None:
        obj.raw_data.fill_(fill)
    return obj


def uint8_layout(size: int) -> dict[int, MemoryLayoutDesc]:
    """The node server's layout of object group 0 when its objects are `memory_obj(size)`."""
    return {0: MemoryLayoutDesc(shapes=[torch.Size([size])], dtypes=[torch.uint8])}


def typed_obj(shape: torch.Size, dtype: torch.dtype, *, seed: int | None = None) -> TensorMemoryObj:
    """A memory object of one KV tensor, as the node server allocates one from its layout;
    random bytes drawn from `seed` when given."""
    data = torch.empty(shape, dtype=dtype)
    raw = data.view(torch.uint8).view(-1)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))
    meta = MemoryObjMetadata(
        shape=shape,
        dtype=dtype,
        address=0,
        phy_size=raw.numel(),
        ref_count=1,
        fmt=MemoryFormat.KV_2LTD,
        shapes=[shape],
        dtypes=[dtype],
    )
    return TensorMemoryObj(raw_data=data, metadata=meta, parent_allocator=None)


def payload_objs(count: int, size: int, *, seed: int = 0) -> list[TensorMemoryObj]:
    gen = torch.Generator().manual_seed(seed)
    objs = []
    for _ in range(count):
        obj = memory_obj(size)
        obj.raw_data.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
        objs.append(obj)
    return objs


def wait_fd(fd: int) -> None:
    """LMCache's own wait (the bench's): poll the event fd, then consume it."""
    assert wait_eventfd(fd, timeout=DEADLINE_S), "the adapter never signalled its event fd"


def store(adapter: Any, ks: list[ObjectKey], objs: list[Any]) -> Any:
    task = adapter.submit_store_task(ks, objs)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        wait_fd(adapter.get_store_event_fd())
        done = adapter.pop_completed_store_tasks()
        if task in done:
            return done[task]
    raise AssertionError("store task never completed")


def _bits(bitmap: Any, n: int) -> list[bool]:
    return [bool(bitmap.test(i)) for i in range(n)]


def lookup_and_lock(
    adapter: Any, ks: list[ObjectKey], layouts: dict[int, Any] | None = None
) -> list[bool]:
    """As the node server looks keys up: with each object group's layout (LMCache's
    MemoryLayoutDesc; none given: each layout this adapter has stored or loaded)."""
    task = adapter.submit_lookup_and_lock_task(ks, layouts or {})
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        wait_fd(adapter.get_lookup_and_lock_event_fd())
        result = adapter.query_lookup_and_lock_result(task)
        if result is not None:
            assert adapter.query_lookup_and_lock_result(task) is None  # returned once
            return _bits(result, len(ks))
    raise AssertionError("lookup task never completed")


def load(adapter: Any, ks: list[ObjectKey], objs: list[Any]) -> list[bool]:
    task = adapter.submit_load_task(ks, objs)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        wait_fd(adapter.get_load_event_fd())
        result = adapter.query_load_result(task)
        if result is not None:
            assert adapter.query_load_result(task) is None
            return _bits(result, len(ks))
    raise AssertionError("load task never completed")
