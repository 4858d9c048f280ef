"""Poison suite: a failed multi-rank store leaves a partial entry later served (LMCache#5344).

Run in the vLLM venv with lmcache added (.ci/vllm-venv, .ci/lmcache-venv), from the repository root:

    .venv-vllm/bin/python bench/poison_ranks.py [--json]

A two-way tensor-parallel engine stores each chunk as two parts, one per KV rank, named as LMCache
names them (its vLLM adapter's `ParallelStrategy`, the node server's `ipc_key_to_object_keys`).
Rank 0 stores its part of every chunk; rank 1 stores its part in two tasks, and the second breaks
(reading chunk 2's memory object raises, as a transfer does when its worker dies), so chunks 0
and 1 are whole and chunks 2 and 3 are torn: only rank 0's part is stored.

Then a later reader (a fresh adapter over the same storage), rank by rank as each TP worker asks
for its own part: lookup, then load what the lookup reported. What the storage served of the torn
chunk is every rank's loaded part in rank order, a part that rank missed left as it was (zeros);
none at all when no rank reported a hit. `poisonlib.judge` compares it with the whole chunk: a
miss is safe, a hit on one rank and a miss on another serves a partial chunk ("wrong"). Whole
chunks must load exact on both sides (a check of the scenario, not a row).

Both adapters are LMCache's L2 adapter interface driven as its controllers drive it: prefixd's
plugin (prefixd/integrations/lmcache) against a daemon, and LMCache's own native filesystem
adapter (`{"type": "fs_native"}`; its Python `fs` adapter needs aiofiles, which this venv lacks). This is the storage layer: LMCache's node server also folds a chunk's ranks
when it plans a prefix prefetch, which the row does not credit to either side.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from poisonlib import Outcome, Row, judge, main

SCENARIO = "a failed multi-rank store leaves a partial entry later served"
WHERE = "LMCache#5344"
PEER_STORAGE = "LMCache 0.5.6 fs_native L2 adapter"
SIZE = 16 << 10
CHUNKS = 4
TORN_FROM = 2  # rank 1's store breaks as it reaches this chunk
HASHES = [bytes([0x40 + i]) * 32 for i in range(CHUNKS)]


class TransferBroken(RuntimeError):
    """The failing rank's transfer broke midway through its store."""


def breaking(obj: Any) -> Any:
    """A memory object over `obj`'s bytes whose bytes cannot be read: the store reaching it
    fails, and stores nothing from there on."""
    from lmcache.v1.memory_management import TensorMemoryObj

    class Broken(TensorMemoryObj):  # type: ignore[misc]
        @property
        def byte_array(self) -> Any:
            raise TransferBroken("rank 1's transfer broke")

    return Broken(raw_data=obj.raw_data, metadata=obj.metadata, parent_allocator=None)


def scenario(build: Callable[[], Any]) -> tuple[Outcome, Outcome]:
    """(torn chunk, whole chunk) as served by the adapters `build` makes over one storage."""
    from tests.integrations.lmcache.harness import (
        load,
        lookup_and_lock,
        memory_obj,
        payload_objs,
        rank_keys,
        store,
        uint8_layout,
        workers,
    )

    engine = workers(tp=2)
    world = engine[0].kv_world_size
    parts: dict[int, list[bytes]] = {}
    adapter = build()
    try:
        for rank in range(world):
            objs = payload_objs(CHUNKS, SIZE, seed=50 + rank)
            parts[rank] = [bytes(o.byte_array) for o in objs]
            keys = rank_keys(HASHES, world, rank)
            if rank < world - 1:
                assert store(adapter, keys, objs).is_successful()
                continue
            # the last rank stores in two tasks, as the node server batches a worker's stores:
            # the first goes through, the transfer breaks in the second
            assert store(adapter, keys[:TORN_FROM], objs[:TORN_FROM]).is_successful()
            broken = [breaking(objs[TORN_FROM]), *objs[TORN_FROM + 1 :]]
            try:
                failed = not store(adapter, keys[TORN_FROM:], broken).is_successful()
            except TransferBroken:  # an adapter that reads every object as the task is submitted
                failed = True
            assert failed, "the broken store succeeded"
    finally:
        adapter.close()
    reader = build()
    try:
        served: dict[int, list[bytes | None]] = {c: [] for c in range(CHUNKS)}
        for worker in engine:
            keys = rank_keys(HASHES, world, worker.kv_worker_id)
            hits = lookup_and_lock(reader, keys, uint8_layout(SIZE))
            outs = [memory_obj(SIZE, fill=0) for _ in keys]
            wanted = [i for i, hit in enumerate(hits) if hit]
            loaded: dict[int, bool] = {}
            if wanted:
                bits = load(reader, [keys[i] for i in wanted], [outs[i] for i in wanted])
                reader.submit_unlock([keys[i] for i in wanted])
                loaded = dict(zip(wanted, bits))
            for chunk in range(CHUNKS):
                got = bytes(outs[chunk].byte_array) if loaded.get(chunk) else None
                served[chunk].append(got)
    finally:
        reader.close()

    def outcome(chunk: int) -> Outcome:
        got = served[chunk]
        whole = b"".join(parts[rank][chunk] for rank in range(world))
        if all(part is None for part in got):
            return judge(whole, None)
        return judge(whole, b"".join(part or bytes(SIZE) for part in got))

    return outcome(TORN_FROM), outcome(0)


def build_from(spec: Callable[[], dict[str, Any]]) -> Callable[[], Any]:
    def build() -> Any:
        from lmcache_adapter import build as lmcache_build

        return lmcache_build(spec())

    return build


def rows(root: Path | None = None) -> list[Row]:
    """The row, its storage (the fs_native directory, the daemon's store) under `root` (default:
    a temporary directory, removed after)."""
    if root is None:
        with tempfile.TemporaryDirectory(prefix="poison-ranks-") as temporary:
            return rows(Path(temporary))
    from suitelib import SuiteDaemon

    from prefixd.integrations.lmcache import l2_adapter_config

    fs_dir = root / "fs_native"
    fs_dir.mkdir()
    peer, peer_whole = scenario(build_from(lambda: {"type": "fs_native", "base_path": str(fs_dir)}))
    with SuiteDaemon(root, "prefixd") as daemon:
        ours, ours_whole = scenario(
            build_from(lambda: l2_adapter_config(str(daemon.socket), weights="sha256:poison"))
        )
    if (peer_whole, ours_whole) != ("exact", "exact"):
        raise RuntimeError(
            f"a whole chunk did not load exact: peer {peer_whole}, prefixd {ours_whole}"
        )
    return [Row(SCENARIO, WHERE, ours, peer, PEER_STORAGE)]


if __name__ == "__main__":
    main(rows, __doc__)
