"""All ranks or none, through LMCache's own L2 adapter interface (lmcache 0.5.6): a chunk that a
tensor-parallel (or pipelined) engine stores as one part per KV rank is a hit only while every
rank's part is stored. The ranks are named as LMCache names them: its vLLM adapter's
`ParallelStrategy` gives each worker its KV world size and rank, and the node server's
`ipc_key_to_object_keys` turns a worker's store (or a lookup, which fans out to every rank) into
the `ObjectKey`s the L2 adapter gets. One rank's store fails midway because the daemon goes away
while it stores; once the daemon is back, every rank's lookup of the torn chunks is a miss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from lmcache.integration.vllm.vllm_multi_process_adapter import ParallelStrategy
from lmcache.v1.distributed.api import ObjectKey
from lmcache.v1.memory_management import TensorMemoryObj

from prefixd.integrations.lmcache import PrefixdL2Adapter, key_of
from prefixd.integrations.lmcache.identity import Identities, Settings, rank_parts
from prefixd.schema.chain import chain_hashes

from ...daemon.conftest import Daemon
from ...store.test_faults import corrupt_stored_chunk
from .harness import (
    MODEL,
    adapter_params,
    load,
    lookup_and_lock,
    memory_obj,
    payload_objs,
    rank_keys,
    store,
    uint8_layout,
    workers,
)

SIZE = 16 << 10
CHUNKS = 4
TORN_FROM = 2  # the failing rank's store breaks as it reaches this chunk
HASHES = [bytes([i + 1]) * 32 for i in range(CHUNKS)]


def object_keys(world: int, worker: int | None) -> list[ObjectKey]:
    return rank_keys(HASHES, world, worker)


class GoneHere(TensorMemoryObj):  # type: ignore[misc]
    """A memory object whose bytes, when the adapter reads them to store them, first run
    `event` (once): the daemon going away as the store reaches this chunk."""

    def __init__(self, obj: TensorMemoryObj, event: Callable[[], None]) -> None:
        super().__init__(raw_data=obj.raw_data, metadata=obj.metadata, parent_allocator=None)
        self._event: Callable[[], None] | None = event

    @property
    def byte_array(self) -> Any:
        event, self._event = self._event, None
        if event is not None:
            event()
        return super().byte_array


def store_ranks(daemon: Daemon, world: int, failing: int | None) -> dict[int, list[bytes]]:
    """Each KV rank's writer stores its part of every chunk, from its own adapter; the store of
    rank `failing` finds the daemon gone from chunk TORN_FROM on (the daemon is back after)."""
    stored = {}
    for rank in range(world):
        adapter = PrefixdL2Adapter(adapter_params(daemon.socket, reconnect_s=0.05))
        try:
            objs = payload_objs(CHUNKS, SIZE, seed=100 + rank)
            stored[rank] = [bytes(o.byte_array) for o in objs]
            if rank == failing:
                objs[TORN_FROM] = GoneHere(objs[TORN_FROM], daemon.stop)
            result = store(adapter, object_keys(world, rank), objs)
            assert result.is_successful() == (rank != failing)
        finally:
            adapter.close()
        if rank == failing:
            daemon.start()
    return stored


def reader_hits(daemon: Daemon, strategy: ParallelStrategy) -> list[bool]:
    """What one worker's lookup of its own part of each chunk finds (a fresh adapter)."""
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        keys = object_keys(strategy.kv_world_size, strategy.kv_worker_id)
        hits = lookup_and_lock(adapter, keys, uint8_layout(SIZE))
        adapter.submit_unlock([k for k, hit in zip(keys, hits) if hit])
        return hits
    finally:
        adapter.close()


LAYOUTS = {
    "tp2": {"tp": 2, "pp": 1, "mla": False},  # two parts per chunk, one per tp rank
    "tp4": {"tp": 4, "pp": 1, "mla": False},
    # MLA: KV whole on every tp rank, so the tp ranks of a stage share one part (LMCache's
    # kv_world_size is pp * dcp); the pipeline stages still split it
    "mla-tp2-pp2": {"tp": 2, "pp": 2, "mla": True},
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_rank_whose_store_failed_midway_makes_the_chunk_a_miss_for_every_rank(
    daemon: Daemon, layout: str
) -> None:
    engine = workers(**LAYOUTS[layout])
    world = engine[0].kv_world_size
    assert world >= 2 and len({w.kv_worker_id for w in engine}) == world
    failing = world - 1
    stored = store_ranks(daemon, world, failing)
    complete = [i < TORN_FROM for i in range(CHUNKS)]
    # every worker, writer or reader of a shared MLA part: the torn chunks are misses
    for strategy in engine:
        assert reader_hits(daemon, strategy) == complete, strategy
    # the node server's own lookup asks for every rank's part at once (chunk-major)
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        keys = object_keys(world, None)
        hits = lookup_and_lock(adapter, keys, uint8_layout(SIZE))
        assert hits == [c for c in complete for _ in range(world)]
        # the hits load byte-exact; the torn chunks' parts that are stored are not served
        outs = [memory_obj(SIZE, fill=0xEE) for _ in keys]
        bits = load(adapter, keys, outs)
        assert bits == hits
        for i, out in enumerate(outs):
            chunk, rank = divmod(i, world)
            if complete[chunk]:
                assert bytes(out.byte_array) == stored[rank][chunk], (chunk, rank)
        adapter.submit_unlock([k for k, hit in zip(keys, hits) if hit])
        # a torn chunk's stored part that the lookup found is not left pinned
        torn_part = adapter._named(keys[TORN_FROM * world], f"uint8[{SIZE}]")
        assert adapter._fetcher.call(lambda c: c.unpin(torn_part[0], [torn_part[1]])) == 0
    finally:
        adapter.close()


def test_a_complete_chunk_is_a_hit_for_every_rank(daemon: Daemon) -> None:
    engine = workers(tp=2, pp=2, mla=False)
    world = engine[0].kv_world_size
    stored = store_ranks(daemon, world, None)
    for strategy in engine:
        assert reader_hits(daemon, strategy) == [True] * CHUNKS
    adapter = PrefixdL2Adapter(adapter_params(daemon.socket))
    try:
        keys = object_keys(world, None)
        assert lookup_and_lock(adapter, keys, uint8_layout(SIZE)) == [True] * len(keys)
        outs = [memory_obj(SIZE) for _ in keys]
        assert load(adapter, keys, outs) == [True] * len(keys)
        assert [bytes(o.byte_array) for o in outs] == [
            stored[rank][chunk] for chunk in range(CHUNKS) for rank in range(world)
        ]
        adapter.submit_unlock(keys)
    finally:
        adapter.close()


@pytest.mark.damages_store
def test_a_part_that_fails_verification_fails_its_chunk_for_every_rank(daemon: Daemon) -> None:
    """A rank's part damaged on disk is a miss for that rank (never its bytes), and a load of
    the chunk's parts together fails them all: never a partial chunk."""
    world = 2
    stored = store_ranks(daemon, world, None)
    params = adapter_params(daemon.socket)
    identity = Identities(Settings.from_params(params)).of(MODEL, 32, "", f"uint8[{SIZE}]")
    assert identity is not None
    damaged = object_keys(world, 1)[1]
    [block] = chain_hashes(identity, key_of(damaged.chunk_hash, damaged.kv_rank, 0))
    daemon.stop()
    corrupt_stored_chunk(daemon.data_dir, block)
    daemon.start()
    adapter = PrefixdL2Adapter(params)
    try:
        keys = object_keys(world, None)  # chunk-major: chunk 1's parts are keys[2:4]
        outs = [memory_obj(SIZE, fill=0xEE) for _ in keys]
        bits = load(adapter, keys, outs)
        assert bits == [True, True, False, False, True, True, True, True]
        assert bytes(outs[3].byte_array) == b"\xee" * SIZE  # the damaged part: never served
        for i in (0, 1, 4, 5, 6, 7):
            chunk, rank = divmod(i, world)
            assert bytes(outs[i].byte_array) == stored[rank][chunk]
        # the damage found, the part is gone: the chunk is a miss for every rank's lookup
        assert lookup_and_lock(adapter, keys, uint8_layout(SIZE)) == [
            True,
            True,
            False,
            False,
            True,
            True,
            True,
            True,
        ]
        adapter.submit_unlock(keys)
    finally:
        adapter.close()


def test_rank_parts_are_the_ranks_lmcache_packs_a_world_into() -> None:
    """Every KV rank of a world names the same parts: the world's ranks as the node server's
    lookup fans out to them. A rank that is no packing of a world of two or more stands alone."""
    for world in range(1, 9):
        fanned = [k.kv_rank for k in rank_keys(HASHES[:1], world, None)]
        for worker in range(world):
            [own] = rank_keys(HASHES[:1], world, worker)
            assert rank_parts(own.kv_rank) == (tuple(fanned) if world > 1 else (own.kv_rank,))
    wide = (1 << 32) | (2 << 24) | (2 << 8)  # a world of two, past 32 bits
    for alone in (0, 1, 3, wide, (2 << 24) | (2 << 16) | (2 << 8)):  # the last: rank >= world
        assert rank_parts(alone) == (alone,)
