"""Hit rate of value-per-byte eviction against plain LRU on the same request trace.

The trace mimics a serving node: every request is a system prompt (one of a few), then a document
(Zipf-popular among many), then a question nobody asks twice. The store holds a fraction of the
working set. For each request the engine looks up the prompt, counts the tokens it can skip, and
publishes the blocks that were missing. Both policies see the identical trace (same seed); the
token hit rate is the share of prompt tokens served from the store.

    python bench/eviction_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from prefixd import Identity, Store

BT = 64
IDENT = Identity(
    model="bench",
    weights="w",
    tokenizer="t",
    template="c",
    rope="r",
    kv_layout="bf16",
    block_tokens=BT,
    tenant="bench",
)


def trace(requests: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, 50_000, 8 * BT, dtype=np.uint32) for _ in range(4)]
    documents = [rng.integers(0, 50_000, 16 * BT, dtype=np.uint32) for _ in range(400)]
    ranks = np.minimum(rng.zipf(1.2, requests) - 1, len(documents) - 1)
    prompts = []
    for i in range(requests):
        question = rng.integers(50_000, 100_000, int(rng.integers(4, 24)) * BT, dtype=np.uint32)
        prompts.append(np.concatenate([systems[i % len(systems)], documents[ranks[i]], question]))
    return prompts


def run(
    policy: str, prompts: list[np.ndarray], capacity: int, block_bytes: int
) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix=f"prefixd-evict-{policy}-"))
    payload = bytes(block_bytes)
    hit_tokens = total_tokens = 0
    started = time.perf_counter()
    try:
        with Store.open(
            work / "s",
            map_size=max(64 << 20, capacity * 3),
            capacity_bytes=capacity,
            eviction=policy,
            sync_interval_s=3600,
        ) as store:
            for prompt in prompts:
                have = store.longest_prefix(IDENT, prompt).n_blocks
                hit_tokens += have * BT
                total_tokens += len(prompt)
                closed = len(prompt) // BT
                store.put(IDENT, prompt, [payload] * (closed - have), first_block=have)
            evicted = store.stats()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "token_hit_rate": round(hit_tokens / total_tokens, 4),
        "blocks_left": evicted.blocks,
        "seconds": round(time.perf_counter() - started, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--capacity-blocks", type=int, default=1500)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    prompts = trace(args.requests, args.seed)
    capacity = args.capacity_blocks * args.block_bytes
    results = {
        policy: run(policy, prompts, capacity, args.block_bytes) for policy in ("value", "lru")
    }
    summary = {
        "requests": args.requests,
        "capacity_blocks": args.capacity_blocks,
        "value": results["value"],
        "lru": results["lru"],
        "value_over_lru": round(
            results["value"]["token_hit_rate"] / max(1e-9, results["lru"]["token_hit_rate"]), 3
        ),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
    }
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
