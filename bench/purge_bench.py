"""How long purging a tenant takes: `--entries` blocks of one tenant beside another tenant's.

The purge removes the tenant's blocks, their chunks, index entries and access records in one
transaction; the other tenant's blocks are checked to be untouched.

    python bench/purge_bench.py --json
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
from prefixd.store import PurgeSelector


def identity(tenant: str) -> Identity:
    return Identity(
        model="bench",
        weights="w",
        tokenizer="t",
        template="c",
        rope="r",
        kv_layout="bf16",
        block_tokens=16,
        tenant=tenant,
    )


def fill(store: Store, ident: Identity, entries: int, payload: bytes, seed: int) -> None:
    rng = np.random.default_rng(seed)
    per_prompt = 50
    for _ in range(entries // per_prompt):
        tokens = rng.integers(0, 150_000, per_prompt * 16, dtype=np.uint32)
        store.put(ident, tokens, [payload] * per_prompt)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--payload-bytes", type=int, default=1024)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="prefixd-purge-"))
    try:
        payload = bytes(args.payload_bytes)
        with Store.open(work / "s", map_size=8 << 30) as store:
            fill(store, identity("victim"), args.entries, payload, 1)
            fill(store, identity("other"), args.entries // 10, payload, 2)
            store.sync()
            started = time.perf_counter()
            report = store.purge(PurgeSelector(tenant="victim"))
            seconds = time.perf_counter() - started
            left = store.stats().blocks
        result = {
            "entries": args.entries,
            "purged_blocks": report.blocks,
            "seconds": round(seconds, 3),
            "us_per_entry": round(seconds / max(1, report.blocks) * 1e6, 2),
            "other_tenant_blocks_left": left,
            "machine": {"platform": platform.platform(), "python": platform.python_version()},
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result) if args.json else "\n".join(f"{k}: {v}" for k, v in result.items()))


if __name__ == "__main__":
    main()
