"""The poison suite's LMCache rows: KV of one engine or session served to another, through
prefixd's L2 adapter and LMCache's own storage (its fs L2 adapter and its local_disk backend).

Run in the vLLM venv with lmcache added (.ci/vllm-venv, .ci/lmcache-venv), from the repository
root:

    .venv-vllm/bin/python bench/poison_lmcache.py [--json]

The L2 adapters are built by LMCache's config parser and plugin factory from a node server's
`--l2-adapter` JSON and driven as its controllers drive them (bench/lmcache_adapter.py). The
local_disk backend is LMCache's non-MP storage manager (the CPU backend as allocator, the disk
backend behind it), keyed as LMCache's vLLM connector keys a chunk: model name, world size,
worker, chunk hash, dtype and the request configs it takes from the request (not its cache
salt). Cache salts come from SGLang's as LMCache's SGLang connector makes them.

* other weights: an engine stores chunks, the store restarts, an engine serving other weights
  under the same model name reads the same chunk hashes (LMCache#4385: another session's KV).
* cache salts: tenants (one also with an SGLang extra key) store other bytes under one chunk hash
  with their own cache salts, each reads its own back and another tenant reads nothing, live and
  after a restart (sglang#37160).
* KV dtype: an engine stores bfloat16 chunks, the store restarts, the engine comes back with
  float16 KV (vLLM's dtype `auto` resolved differently, vllm PR #49438): the same model, weights
  and chunk hashes, and chunks of the same size. It reads the chunks as float16, then as bfloat16.
* bit rot: an engine stores chunks, one byte of one stored chunk flips where the storage keeps it
  on disk, and the engine reads them back (live: local_disk recovers nothing across a restart).

Memory objects are one float16 (or bfloat16) KV tensor, and lookups carry its layout, as the node
server allocates and looks them up.
"""

from __future__ import annotations

import sys
import tempfile
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

import torch
from lmcache.integration.sglang.unified_lmcache_mp_connector import UnifiedLMCacheMPConnector
from lmcache.integration.vllm.utils import extract_request_configs_from_request
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.distributed.api import MemoryLayoutDesc
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache_adapter import build
from poisonlib import Outcome, Row, files_under, judge, main, rot, store_files
from suitelib import SuiteDaemon

from prefixd.integrations.lmcache import l2_adapter_config
from tests.integrations.lmcache.harness import MODEL, keys, load, lookup_and_lock, store, typed_obj
from tests.waiting import wait_for

KV_SHAPE = torch.Size([2, 2, 256, 64])  # a chunk's K and V: 2 layers, 256 tokens, float16
SIZE = 2 * KV_SHAPE.numel()
CHUNKS = 4
WEIGHTS = "sha256:engine-a"
ROTTEN_CHUNK = 1


def payloads(seed: int) -> list[bytes]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (SIZE,), dtype=torch.uint8, generator=generator).numpy().tobytes()
        for _ in range(CHUNKS)
    ]


def salt_of(tenant: str, extra_key: str | None = None) -> str:
    """An SGLang request's cache salt (and extra key) as LMCache's SGLang connector puts it in
    ObjectKey."""
    return str(UnifiedLMCacheMPConnector.build_cache_salt(tenant, extra_key))


class Adapter:
    """An L2 adapter (prefixd's, or LMCache's fs) as a node server builds and drives it;
    `files`: where it keeps the chunks."""

    def __init__(
        self, name: str, spec: Any, restart: Any, files: Callable[[], Iterable[Path]]
    ) -> None:
        self.name, self.spec, self.restart, self.files = name, spec, restart, files

    @contextmanager
    def open(self, weights: str) -> Iterator[Any]:
        adapter = build(self.spec(weights))
        try:
            yield adapter
        finally:
            adapter.close()

    def put(
        self,
        adapter: Any,
        start: int,
        salt: str,
        data: Sequence[bytes],
        dtype: torch.dtype = torch.float16,
    ) -> None:
        objs = [typed_obj(KV_SHAPE, dtype) for _ in data]
        for obj, payload in zip(objs, data):
            obj.byte_array.cast("B")[:] = payload
        assert store(adapter, keys(len(data), start=start, salt=salt), objs).is_successful()

    def get(
        self, adapter: Any, start: int, salt: str, dtype: torch.dtype = torch.float16
    ) -> list[bytes | None]:
        """As a node server reads keys: lookup and lock with the objects' layout, load into
        fresh objects, unlock."""
        ks = keys(CHUNKS, start=start, salt=salt)
        found = lookup_and_lock(adapter, ks, {0: MemoryLayoutDesc([KV_SHAPE], [dtype])})
        outs = [typed_obj(KV_SHAPE, dtype) for _ in ks]
        bits = load(adapter, ks, outs)
        adapter.submit_unlock([k for k, hit in zip(ks, found) if hit])
        return [bytes(o.byte_array) if b else None for b, o in zip(bits, outs)]


class LocalDisk:
    """LMCache's local_disk backend behind its non-MP storage manager, in this process; a
    restart is a new manager over the same directory."""

    name = "LMCache local_disk backend"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = files_under(path)

    @contextmanager
    def open(self, weights: str) -> Iterator[StorageManager]:
        # weights: nothing in LMCache's config or keys says which weights made a chunk
        config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=False,  # every get is the disk's
            max_local_cpu_size=0.05,
            local_disk=f"file://{self.path}",
            max_local_disk_size=0.05,
        )
        metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.float16,
            kv_shape=(2, 2, 256, 2, 32),
            role="worker",
        )
        manager = StorageManager(config, metadata, EventManager())
        try:
            yield manager
        finally:
            manager.close()

    def restart(self) -> None:
        """Nothing to stop: the next `open` is the restarted engine's manager."""

    @staticmethod
    def key(chunk: int, salt: str, dtype: torch.dtype) -> CacheEngineKey:
        """As LMCache's vLLM connector keys a chunk of a request carrying `salt`."""
        request = types.SimpleNamespace(
            sampling_params=types.SimpleNamespace(extra_args=None), cache_salt=salt
        )
        configs = extract_request_configs_from_request(request)
        return CacheEngineKey(MODEL, 1, 0, chunk, dtype, configs)

    def put(
        self,
        manager: StorageManager,
        start: int,
        salt: str,
        data: Sequence[bytes],
        dtype: torch.dtype = torch.float16,
    ) -> None:
        ks = [self.key(start + i, salt, dtype) for i in range(len(data))]
        objs = []
        for payload in data:
            obj = manager.allocate(KV_SHAPE, dtype)
            assert obj is not None, "LMCache's CPU allocator is full"
            obj.byte_array.cast("B")[:] = payload
            objs.append(obj)
        manager.batched_put(ks, objs)
        wait_for(
            lambda: all(manager.contains(k, ["LocalDiskBackend"]) for k in ks),
            "LMCache's disk backend holding the stored chunks",
        )

    def get(
        self, manager: StorageManager, start: int, salt: str, dtype: torch.dtype = torch.float16
    ) -> list[bytes | None]:
        got = [manager.get(self.key(start + i, salt, dtype)) for i in range(CHUNKS)]
        return [None if obj is None else bytes(obj.byte_array) for obj in got]


def overall(pairs: Sequence[tuple[bytes | None, bytes | None]]) -> Outcome:
    """A scenario's outcome from (expected, served) per read: wrong if any read served other
    bytes; exact if every read that should be served was, exactly; else miss."""
    outcomes = [judge(expected, served) for expected, served in pairs]
    if "wrong" in outcomes:
        return "wrong"
    wanted = [o for (expected, _), o in zip(pairs, outcomes) if expected is not None]
    return "exact" if wanted and all(o == "exact" for o in wanted) else "miss"


def other_weights(storage: Any, start: int) -> Outcome:
    with storage.open(WEIGHTS) as handle:
        storage.put(handle, start, "", payloads(start))
    storage.restart()
    with storage.open("sha256:engine-b") as handle:
        served = storage.get(handle, start, "")
    return overall([(None, s) for s in served])


def cache_salts(storage: Any, start: int) -> Outcome:
    tenants = {
        salt_of("tenant-a"): payloads(start),
        salt_of("tenant-b"): payloads(start + 1),
        salt_of("tenant-a", "lora-7"): payloads(start + 2),  # the connector hashes the two
    }
    pairs: list[tuple[bytes | None, bytes | None]] = []

    def read_back(handle: Any) -> None:
        for salt, data in tenants.items():
            pairs.extend(zip(data, storage.get(handle, start, salt)))
        pairs.extend((None, s) for s in storage.get(handle, start, salt_of("tenant-c")))

    with storage.open(WEIGHTS) as handle:
        for salt, data in tenants.items():
            storage.put(handle, start, salt, data)
        read_back(handle)
    storage.restart()
    with storage.open(WEIGHTS) as handle:
        read_back(handle)
    return overall(pairs)


def other_dtype(storage: Any, start: int) -> Outcome:
    data = payloads(start)
    with storage.open(WEIGHTS) as handle:
        storage.put(handle, start, "", data, torch.bfloat16)
    storage.restart()
    with storage.open(WEIGHTS) as handle:
        as_fp16 = storage.get(handle, start, "", torch.float16)
        as_bf16 = storage.get(handle, start, "", torch.bfloat16)
    return overall([(None, s) for s in as_fp16] + list(zip(data, as_bf16)))


def rotten(storage: Any, start: int) -> Outcome:
    data = payloads(start)
    with storage.open(WEIGHTS) as handle:
        storage.put(handle, start, "", data)
        rot(storage.files(), data[ROTTEN_CHUNK])
        served = storage.get(handle, start, "")
    right = [None if i == ROTTEN_CHUNK else payload for i, payload in enumerate(data)]
    return overall(list(zip(right, served)))


def rows(root: Path | None = None) -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="poison-lmcache-") as tmp:
        base = root or Path(tmp)
        (base / "fs").mkdir(parents=True)
        daemon = SuiteDaemon(base, "prefixd")
        daemon.start()
        try:
            ours = Adapter(
                "prefixd",
                lambda weights: l2_adapter_config(str(daemon.socket), weights=weights),
                daemon.restart,
                store_files(daemon.data_dir),
            )
            fs = Adapter(
                "LMCache fs L2 adapter",
                lambda weights: {"type": "fs", "base_path": str(base / "fs")},
                lambda: None,  # a new adapter reopens the directory
                files_under(base / "fs"),
            )
            disk = LocalDisk(base / "disk")
            out = []
            for scenario, where, run, start in (
                ("another engine's weights under the same model name, after a restart",
                 "LMCache#4385", other_weights, 100),
                ("one chunk hash under two cache salts, live and after a restart",
                 "sglang#37160", cache_salts, 200),
                ("KV dtype changed across a restart (bfloat16 to float16), same weights",
                 "vllm PR #49438", other_dtype, 300),
                ("a byte of a stored chunk flipped on disk (bit rot)",
                 "measured here", rotten, 400),
            ):  # fmt: skip
                prefixd = run(ours, start)
                for peer in (fs, disk):
                    out.append(Row(scenario, where, prefixd, run(peer, start), peer.name))
            return out
        finally:
            daemon.close()


if __name__ == "__main__":
    main(rows, __doc__)
