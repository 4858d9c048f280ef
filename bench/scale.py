"""Does the daemon's cost grow with the store's size? A large store (1,000,000 entries in full
mode) against a small one (1,000 entries), measured the same way, both daemons up at once:

* build:   the stores are written with the library (`prefixd.Store`, no daemon): chains of
           `CHAIN_BLOCKS` blocks of `BLOCK_TOKENS` tokens with tiny payloads, one put (one
           transaction) per chain, then one sync. Its time is reported, not compared.
* start:   spawn -> READY=1 -> a `hello` answered on a fresh connection.
* memory:  the daemon's VmRSS after the start and after the lookups, and its two parts: RssAnon
           (the daemon's own memory) and RssFile (pages of mapped files, the LMDB map's pages
           among them, which the lookups fault in: page cache, shared and reclaimable).
* lookup:  `Client.lookup` of a stored chain (uniformly random) plus one block never stored, so
           every lookup walks the whole chain in the store and ends on a miss; small and large
           interleaved; p50 and p99. Both daemons run without the lookup memo
           (`verified_cache_bytes=0`, through bench/tuned.py): with it, the small store's 20 chains all fit the memo and
           its lookups skip the walk, while only a fifth of the large store's 20,000 do, so the
           ratio would measure the working set against the memo's size (1.9x here), not the
           store's size (1.2x).

The ratios are large / small; `max_factor` is the bound the suite holds them to (reported, not
enforced).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
from suitelib import GiB, SuiteDaemon, percentiles_us, ratio

from prefixd import Identity, Store
from prefixd.client import Client

BLOCK_TOKENS = 16
PAYLOAD_BYTES = 16
CHAIN_BLOCKS = 50
SMALL_ENTRIES = 1000
MAX_FACTOR = 3.0
NO_MEMO = ("verified_cache_bytes=0",)  # every lookup walks its chain (see the docstring)
VOCAB = 128_000
SEED = 20240603

IDENTITY = Identity(
    model="bench-scale",
    weights="sha256:" + "1" * 64,
    tokenizer="bench-tokenizer",
    template="v1",
    rope="rope-default",
    kv_layout=f"bf16/tp1/rank0/{PAYLOAD_BYTES}B",
    block_tokens=BLOCK_TOKENS,
    tenant="bench-scale",
)


def chain_tokens(store_seed: int, chain: int) -> np.ndarray:
    """The tokens of chain `chain` of a store: regenerated on demand, never kept."""
    rng = np.random.default_rng((SEED, store_seed, chain))
    return rng.integers(0, VOCAB, CHAIN_BLOCKS * BLOCK_TOKENS, dtype=np.uint32)


def build(path: Path, entries: int, store_seed: int) -> dict[str, Any]:
    chains = max(1, entries // CHAIN_BLOCKS)
    payloads = [bytes(range(PAYLOAD_BYTES))] * CHAIN_BLOCKS
    started = time.perf_counter()
    with Store.open(path, map_size=8 * GiB, sync_interval_s=3600.0, verify_threads=0) as store:
        for chain in range(chains):
            result = store.put(IDENTITY, chain_tokens(store_seed, chain), payloads)
            if result.stored != CHAIN_BLOCKS:
                raise RuntimeError(f"chain {chain}: stored {result.stored} of {CHAIN_BLOCKS}")
        store.sync()
        stats = store.stats()
    seconds = time.perf_counter() - started
    return {
        "entries": stats.blocks,
        "chains": chains,
        "build_s": round(seconds, 3),
        "build_entries_per_s": round(stats.blocks / seconds),
        "map_used_bytes": stats.map_used_bytes,
    }


def lookup_prompts(
    store_seed: int, chains: int, count: int, rng: np.random.Generator
) -> list[np.ndarray]:
    picks = rng.integers(0, chains, count)
    never_stored = VOCAB  # token ids from here on are in no stored chain
    return [
        np.concatenate(
            [
                chain_tokens(store_seed, int(c)),
                rng.integers(never_stored, 2 * never_stored, BLOCK_TOKENS, dtype=np.uint32),
            ]
        )
        for c in picks
    ]


def measure(root: Path, *, large_entries: int, lookups: int, warmup: int) -> dict[str, Any]:
    sizes = {"small": SMALL_ENTRIES, "large": large_entries}
    stores: dict[str, dict[str, Any]] = {}
    daemons: dict[str, SuiteDaemon] = {}
    times: dict[str, list[float]] = {name: [] for name in sizes}
    clients: dict[str, Client] = {}
    try:
        for seed, (name, entries) in enumerate(sizes.items()):
            daemons[name] = daemon = SuiteDaemon(root, f"scale-{name}", knobs=NO_MEMO)
            stores[name] = build(daemon.data_dir, entries, seed)
        rng = np.random.default_rng(SEED)
        prompts = {
            name: lookup_prompts(seed, stores[name]["chains"], warmup + lookups, rng)
            for seed, name in enumerate(sizes)
        }
        for name in sizes:
            daemons[name].start()
            stores[name]["start_s"] = round(daemons[name].start_s, 3)
            stores[name]["memory_after_start"] = daemons[name].memory()
        for name in sizes:
            clients[name] = Client(daemons[name].socket)
        clock = time.perf_counter
        for i in range(warmup + lookups):
            for name in sizes if i % 2 else reversed(sizes):
                prompt = prompts[name][i]
                started = clock()
                [hit] = clients[name].lookup(IDENTITY, [prompt])
                elapsed = clock() - started
                if hit.n_blocks != CHAIN_BLOCKS:
                    raise RuntimeError(f"{name}: lookup found {hit.n_blocks} of {CHAIN_BLOCKS}")
                if i >= warmup:
                    times[name].append(elapsed)
        for name in sizes:
            stores[name]["memory_after_lookups"] = daemons[name].memory()
            stores[name]["lookup_us"] = percentiles_us(times[name])
    finally:
        for client in clients.values():
            client.close()
        for daemon in daemons.values():
            daemon.close()
    small, large = stores["small"], stores["large"]
    ratios = {
        "lookup_p50": ratio(large["lookup_us"]["p50"], small["lookup_us"]["p50"]),
        "lookup_p99": ratio(large["lookup_us"]["p99"], small["lookup_us"]["p99"]),
        "rss_after_start": ratio(
            large["memory_after_start"]["rss"], small["memory_after_start"]["rss"]
        ),
        "rss_after_lookups": ratio(
            large["memory_after_lookups"]["rss"], small["memory_after_lookups"]["rss"]
        ),
        "start_s": ratio(large["start_s"], small["start_s"]),
    }
    for part in ("rss_anon", "rss_file"):  # VmRSS's parts: the daemon's own memory, and the
        # pages of mapped files (LMDB's map among them: page cache, shared and reclaimable)
        ratios[f"{part}_after_lookups"] = ratio(
            large["memory_after_lookups"][part], small["memory_after_lookups"][part]
        )
    return {
        "small": small,
        "large": large,
        "ratios_large_to_small": ratios,
        "max_factor": MAX_FACTOR,
        "within_factor": {k: v is not None and v <= MAX_FACTOR for k, v in ratios.items()},
        "settings": {
            "block_tokens": BLOCK_TOKENS,
            "payload_bytes": PAYLOAD_BYTES,
            "chain_blocks": CHAIN_BLOCKS,
            "lookups": lookups,
            "warmup": warmup,
            "lookup_prompt_blocks": CHAIN_BLOCKS + 1,
        },
    }
