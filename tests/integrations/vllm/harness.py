"""vLLM's scheduler-side offloading, driven as vLLM drives it, without an engine: a real
TieringOffloadingSpec and TieringOffloadingManager over a real CPU primary tier, secondary tiers
loaded through vLLM's own factory (`module_path` for prefixd). Used by the tier's tests and by
bench/vllm_bench.py. Runs only in the vLLM venv."""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

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


def prefixd_tier(socket: str, **tier: Any) -> dict[str, Any]:
    """The `secondary_tiers` entry of a prefixd tier (the tests' identity fields, unless given)."""
    return {
        "type": "PrefixdTier",
        "module_path": "prefixd.integrations.vllm",
        "socket": socket,
        "identity": FIELDS,
        **tier,
    }


def offloading_config(
    tier: dict[str, Any], row_bytes: int = ROW_BYTES, rows: int = 64, events: bool = False
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS_PER_BLOCK, ("layer.0", "layer.1"), 0),),
        worker_kv_bytes_per_block=row_bytes,
        enable_kv_cache_events=events,
        extra_config={"cpu_bytes_to_use": rows * row_bytes, "secondary_tiers": [tier]},
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


def scheduler_lookup(manager: Any, ctx: ReqContext, keys: list[bytes]) -> int | None:
    """One scheduler step's lookup, as vLLM's offloading scheduler does it
    (OffloadingConnectorScheduler._lookup): consecutive hits from the first key, or None while
    the manager is still answering (RETRY) or loading (HIT_PENDING)."""
    hits, deferred = 0, False
    for key in keys:
        result = manager.lookup(key, ctx)
        if result is LookupResult.HIT:
            hits += 1
        elif result is LookupResult.HIT_PENDING:
            hits, deferred = hits + 1, True
        elif result is LookupResult.RETRY:
            deferred = True
        else:
            break
    return None if deferred else hits


def settle(manager: Any, ctx: ReqContext, keys: list[bytes], step: Any, poll_s: float) -> int:
    """Look up and `step` (every `poll_s`, as vLLM's scheduler steps) until the lookup settles:
    how many leading keys are hits."""
    manager.on_new_request(ctx)
    found: list[int | None] = []

    def settled() -> bool:
        found.append(scheduler_lookup(manager, ctx, keys))
        if found[-1] is None:
            step()
            return False
        return True

    wait_for(settled, "a lookup to settle", poll_s=poll_s)
    hits = found[-1]
    assert hits is not None
    return hits


@dataclass
class Engine:
    """One engine's scheduler-side offloading: vLLM's spec and manager with a prefixd tier."""

    spec: TieringOffloadingSpec
    manager: Any

    @classmethod
    def start(cls, socket: str, **tier: Any) -> Engine:
        """An engine with a prefixd tier on `socket`."""
        return cls.with_tier(prefixd_tier(socket, **tier))

    @classmethod
    def with_tier(
        cls, tier: dict[str, Any], row_bytes: int = ROW_BYTES, rows: int = 64, events: bool = False
    ) -> Engine:
        """An engine with `tier` (a `secondary_tiers` entry); `events`: vLLM's KV events on."""
        spec = TieringOffloadingSpec(offloading_config(tier, row_bytes, rows, events))
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

    def scheduler_lookup(self, ctx: ReqContext, keys: list[bytes]) -> int | None:
        return scheduler_lookup(self.manager, ctx, keys)

    def settle(self, ctx: ReqContext, keys: list[bytes], poll_s: float = 0.02) -> int:
        """Step as the scheduler does (every `poll_s`) until its lookup settles: how many
        leading keys are then in the primary tier (loaded from the tiers where they were not)."""

        def step() -> None:
            self.step()  # flushes the lookups and submits the promotions' loads
            self.tier.drain_jobs()

        return settle(self.manager, ctx, keys, step, poll_s)

    def read(self, ctx: ReqContext, keys: list[bytes]) -> list[bytes]:
        """The primary tier's rows of `keys` (which must be there), as vLLM's load reads them."""
        if not keys:
            return []
        spec = self.manager.prepare_load(keys, ctx)
        rows = self.rows()
        return [rows[int(chunk)].tobytes() for chunk in spec.block_ids]

    def load(self, ctx: ReqContext, keys: list[bytes], poll_s: float = 0.02) -> list[bytes]:
        """Settle the lookup, then read the rows of the keys found."""
        return self.read(ctx, keys[: self.settle(ctx, keys, poll_s)])

    def close(self) -> None:
        self.manager.shutdown()
