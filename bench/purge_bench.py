"""How long purging a tenant takes, without and with clearing the files, and what it costs others.

Two stores get the same entries: `--entries` blocks of a victim tenant interleaved with a tenth as
many of another tenant. The first is purged as a retirement without `scrub_retired` (the old path:
one transaction, nothing cleared), the second as the tenant's purge, which clears the store's files
(prefixd.store.scrub). In the same run, the other tenant's loads and puts are timed on the second
store before the purge, while it clears, and after: ratios in the same run.

    python bench/purge_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from prefixd import Identity, Store
from prefixd.store import PurgeSelector

PER_PROMPT = 16
TOKENS = 16


def identity(tenant: str, model: str) -> Identity:
    return Identity(
        model=model,
        weights="w",
        tokenizer="t",
        template="c",
        rope="r",
        kv_layout="bf16",
        block_tokens=TOKENS,
        tenant=tenant,
    )


VICTIM, OTHER = identity("victim", "victim-model"), identity("other", "m")


def fill(store: Store, entries: int, payload_bytes: int) -> list[np.ndarray]:
    """The victim's entries interleaved with the other tenant's; the other's prompts."""
    rng = np.random.default_rng(1)
    payload = rng.bytes(payload_bytes)
    prompts = []
    for n in range(entries // PER_PROMPT):
        tokens = rng.integers(0, 150_000, PER_PROMPT * TOKENS, dtype=np.uint32)
        store.put(VICTIM, tokens, [payload] * PER_PROMPT)
        if n % 10 == 0:
            tokens = rng.integers(0, 150_000, PER_PROMPT * TOKENS, dtype=np.uint32)
            store.put(OTHER, tokens, [payload] * PER_PROMPT)
            prompts.append(tokens)
    store.sync()
    return prompts


def other_tenant(
    store: Store,
    prompts: list[np.ndarray],
    payload_bytes: int,
    seconds: float,
    stop: threading.Event,
) -> dict[str, float]:
    """Loads and puts of the other tenant for `seconds` (or until `stop`): ops/s of each."""
    rng = np.random.default_rng(int(time.time_ns() % 1000))
    out = bytearray(PER_PROMPT * payload_bytes)
    payload = bytes(payload_bytes)
    loads = puts = 0
    load_s = put_s = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline and not stop.is_set():
        started = time.perf_counter()
        found = store.load(OTHER, prompts[loads % len(prompts)], out)
        assert found.n_blocks == PER_PROMPT
        load_s += time.perf_counter() - started
        loads += 1
        if loads % 8 == 0:
            tokens = rng.integers(0, 150_000, 4 * TOKENS, dtype=np.uint32)
            started = time.perf_counter()
            store.put(OTHER, tokens, [payload] * 4)
            put_s += time.perf_counter() - started
            puts += 1
    return {
        "loads_per_s": round(loads / load_s, 1) if load_s else 0.0,
        "puts_per_s": round(puts / put_s, 1) if put_s else 0.0,
        "loads": loads,
        "puts": puts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--entries", type=int, default=16_000)
    parser.add_argument("--payload-bytes", type=int, default=8192)
    parser.add_argument("--seconds", type=float, default=2.0, help="each timing of the others")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prefixd-purge-"))
    result: dict[str, Any] = {"entries": args.entries, "payload_bytes": args.payload_bytes}
    try:
        with Store.open(work / "old", map_size=8 << 30) as store:
            fill(store, args.entries, args.payload_bytes)
            started = time.perf_counter()
            plain = store.purge(PurgeSelector(model=VICTIM.model))  # scrub_retired off
            result["purge_s_without_clearing"] = round(time.perf_counter() - started, 3)
            assert plain.cleared is None
        with Store.open(work / "new", map_size=8 << 30) as store:
            prompts = fill(store, args.entries, args.payload_bytes)
            result["data_mdb_bytes"] = os.path.getsize(work / "new" / "data.mdb")
            never = threading.Event()
            result["others_before"] = other_tenant(
                store, prompts, args.payload_bytes, args.seconds, never
            )
            done = threading.Event()
            during: dict[str, float] = {}
            timer = threading.Thread(
                target=lambda: during.update(
                    other_tenant(store, prompts, args.payload_bytes, 3600.0, done)
                )
            )
            timer.start()
            started = time.perf_counter()
            report = store.purge(PurgeSelector(tenant=VICTIM.tenant))
            seconds = time.perf_counter() - started
            done.set()
            timer.join()
            assert report.cleared is not None
            cleared = report.cleared
            result["purge_s_with_clearing"] = round(seconds, 3)
            result["purged_blocks"] = report.blocks
            result["clearing"] = cleared.describe()
            written = cleared.zero_filled_bytes + cleared.cleared_bytes
            result["clearing_mb_per_s"] = round(written / cleared.seconds / 1e6, 1)
            result["others_during_clearing"] = during
            result["others_after"] = other_tenant(
                store, prompts, args.payload_bytes, args.seconds, never
            )
        before = result["others_before"]
        for phase in ("others_during_clearing", "others_after"):
            for kind in ("loads_per_s", "puts_per_s"):
                if before[kind] and result[phase][kind]:
                    result[f"{phase}_{kind}_ratio"] = round(result[phase][kind] / before[kind], 3)
        result["machine"] = {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
