"""PrefixdTier driven by vLLM's own code: a real TieringOffloadingManager over a real CPU primary
tier, the tier loaded through vLLM's `module_path` factory, and a real prefixd daemon.

Store in one manager (vLLM cascades the primary tier's rows to the tier), then look up and load
in a fresh manager with an empty primary tier: the bytes that arrive are the bytes stored."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from prefixd.client import Client

from ...daemon.conftest import Daemon, DaemonFactory, daemon, daemon_factory, sock_dir  # noqa: F401
from ...waiting import wait_for

TOKENS_PER_BLOCK = 32
ROW_BYTES = 4096  # bytes of one chunk in the primary tier (one block per chunk)
FIELDS = {
    "model": "tiny",
    "weights": "w1",
    "tokenizer": "t",
    "template": "none",
    "rope": "{}",
    "kv_layout": "dtype=float32 cache=auto",
    "adapter": None,
    "mm": None,
}


def offloading_config(socket: str, **tier: Any) -> OffloadingConfig:
    tier_settings = {
        "type": "PrefixdTier",
        "module_path": "prefixd.integrations.vllm",
        "socket": socket,
        "identity": FIELDS,
        **tier,
    }
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS_PER_BLOCK, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=ROW_BYTES,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": 64 * ROW_BYTES, "secondary_tiers": [tier_settings]},
        engine_id=f"prefixd-test-{uuid.uuid4().hex[:8]}",  # a fresh primary region each time
        model=OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=OffloadingCacheConfig(tokens_per_hash=TOKENS_PER_BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
    )


def request_keys(seed: int, n: int) -> list[bytes]:
    keys, parent = [], seed.to_bytes(8, "big")
    for _ in range(n):
        parent = hashlib.sha256(parent).digest()
        keys.append(make_offload_key(parent, 0))
    return keys


def context(req_id: str, keys: list[bytes]) -> ReqContext:
    """A request's context as vLLM's scheduler fills it: every key's end-token position."""
    ctx = ReqContext(req_id=req_id)
    for i, key in enumerate(keys):
        ctx.set_offload_key_position(key, (i + 1) * TOKENS_PER_BLOCK)
    return ctx


@dataclass
class Engine:
    """One engine's scheduler-side offloading: vLLM's spec and manager with a prefixd tier."""

    spec: TieringOffloadingSpec
    manager: Any

    @classmethod
    def start(cls, socket: str, **tier: Any) -> Engine:
        spec = TieringOffloadingSpec(offloading_config(socket, **tier))
        return cls(spec, spec.get_manager())

    @property
    def tier(self) -> Any:
        return self.manager.secondary_tiers[0]

    def rows(self) -> np.ndarray:
        view = self.manager.primary_tier.get_kv_memoryview()
        return np.frombuffer(view, dtype=np.uint8).reshape(-1, view.strides[0])

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext((), ()))

    def store(self, ctx: ReqContext, keys: list[bytes], payloads: list[bytes]) -> None:
        """What vLLM does after a forward pass: rows into the primary tier, then cascade."""
        self.manager.on_new_request(ctx)
        prepared = self.manager.prepare_store(keys, ctx)
        assert prepared is not None and list(prepared.keys_to_store) == keys
        rows = self.rows()
        for chunk, data in zip(prepared.store_spec.block_ids, payloads):
            rows[int(chunk)][: len(data)] = np.frombuffer(data, dtype=np.uint8)
        self.manager.complete_store(keys, ctx)
        self.tier.drain_jobs()
        self.step()  # the finished cascade is collected

    def lookup_until_settled(self, ctx: ReqContext, key: bytes) -> LookupResult:
        """vLLM's lookup loop: RETRY while the tier's lookup thread asks the daemon, HIT_PENDING
        while the promotion's load runs, then HIT or MISS."""
        results: list[LookupResult] = []

        def settled() -> bool:
            results.append(self.manager.lookup(key, ctx))
            if results[-1] in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                self.step()  # flushes lookups and submits promotions
                self.tier.drain_jobs()
                return False
            return True

        wait_for(settled, "a lookup through the tier to settle")
        return results[-1]

    def load(self, ctx: ReqContext, keys: list[bytes]) -> list[bytes]:
        """Look each key up in prefix order until the first miss, then read the loaded rows."""
        self.manager.on_new_request(ctx)
        hits = []
        for key in keys:
            if self.lookup_until_settled(ctx, key) is not LookupResult.HIT:
                break
            hits.append(key)
        if not hits:
            return []
        spec = self.manager.prepare_load(hits, ctx)
        rows = self.rows()
        return [rows[int(chunk)].tobytes() for chunk in spec.block_ids]

    def close(self) -> None:
        self.manager.shutdown()


@pytest.fixture
def engines(daemon: Daemon) -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()


def rows_of(seed: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, ROW_BYTES, dtype=np.uint8).tobytes() for _ in range(n)]


def test_a_fresh_engine_loads_what_another_stored(daemon: Daemon, engines: list[Engine]) -> None:
    keys, payloads = request_keys(1, 6), rows_of(1, 6)
    first = Engine.start(str(daemon.socket))
    engines.append(first)
    first.store(context("a", keys), keys, payloads)
    with Client(daemon.socket) as client:
        assert client.stats()["store"]["blocks"] == 6

    second = Engine.start(str(daemon.socket))  # an empty primary tier
    engines.append(second)
    assert second.load(context("b", keys), keys) == payloads


def test_a_hit_stops_at_the_first_block_the_tier_lacks(
    daemon: Daemon, engines: list[Engine]
) -> None:
    keys, payloads = request_keys(2, 6), rows_of(2, 6)
    first = Engine.start(str(daemon.socket))
    engines.append(first)
    first.store(context("a", keys[:3]), keys[:3], payloads[:3])
    second = Engine.start(str(daemon.socket))
    engines.append(second)
    assert second.load(context("b", keys), keys) == payloads[:3]


def test_another_identity_is_a_miss(daemon: Daemon, engines: list[Engine]) -> None:
    keys, payloads = request_keys(3, 2), rows_of(3, 2)
    first = Engine.start(str(daemon.socket))
    engines.append(first)
    first.store(context("a", keys), keys, payloads)
    for tier in ({"tenant": "other"}, {"identity": {**FIELDS, "weights": "w2"}}):
        other = Engine.start(str(daemon.socket), **tier)
        engines.append(other)
        assert other.load(context("b", keys), keys) == []


def test_a_daemon_that_is_down_is_a_miss_and_comes_back(
    daemon_factory: DaemonFactory, engines: list[Engine]
) -> None:
    daemon = daemon_factory()
    keys, payloads = request_keys(4, 3), rows_of(4, 3)
    engine = Engine.start(str(daemon.socket), reconnect_s=0.0)
    engines.append(engine)
    engine.store(context("a", keys), keys, payloads)
    daemon.stop()
    fresh = Engine.start(str(daemon.socket), reconnect_s=0.0)
    engines.append(fresh)
    assert fresh.load(context("b", keys), keys) == []  # misses; nothing raised
    daemon.start()
    back = Engine.start(str(daemon.socket), reconnect_s=0.0)
    engines.append(back)
    wait_for(lambda: back.load(context(uuid.uuid4().hex, keys), keys) == payloads, "reconnect")
