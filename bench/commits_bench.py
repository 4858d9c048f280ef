"""Group commit: single-block puts from several threads, grouped and one transaction each.

Each round writes `--puts` 16 KiB single-block puts (new roots) into a fresh library store from
`--threads` threads, with group commit (prefixd.store.commits, as the store runs) and with every put
in a transaction of its own (the commit queue bypassed: what the store did before), alternately,
under both durability modes; medians of `--rounds` rounds. Group commit pays where commits cost
most: under `full` every commit is two flushes, which a group shares.

    python bench/commits_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from benchlib import bench_identity

from prefixd import Store
from prefixd.store import commits
from prefixd.store.allocator import keep_write_buffers

BLOCK_BYTES = 16 << 10
BLOCK_TOKENS = 16


def one_by_one(store: Store) -> None:
    """Bypass the commit queue: each put in a transaction of its own."""
    queue = store._writer._commits

    def alone(body: Callable[[lmdb.Transaction], Any]) -> Any:
        with queue.held():  # LMDB's writer lock would serialise them the same way
            return commits.transact(queue._ctx, body, queue._aborts)

    queue.run = alone  # type: ignore[method-assign]


def round_(root: Path, durability: str, grouped: bool, threads: int, puts: int, seed: int) -> float:
    """Puts per second of one round into a fresh store."""
    rng = np.random.default_rng(seed)
    ident = bench_identity(BLOCK_TOKENS, BLOCK_BYTES)
    prompts = rng.integers(0, 50_000, (puts, BLOCK_TOKENS), dtype=np.uint32)
    payload = rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes()
    path = root / f"{durability}-{grouped}"
    with Store.open(path, map_size=4 << 30, durability=durability) as store:
        if not grouped:
            one_by_one(store)

        def work(k: int) -> None:
            for i in range(k, puts, threads):
                store.put(ident, prompts[i], [payload])

        workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        started = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        elapsed = time.perf_counter() - started
        groups = store._writer._commits.groups
    shutil.rmtree(path)
    assert grouped or groups == 0
    return puts / elapsed


def measure(root: Path, threads: int, puts: int, rounds: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for durability in ("full", "periodic"):
        n = puts if durability == "periodic" else max(1, puts // 4)
        seen: dict[str, list[float]] = {"grouped": [], "one_by_one": []}
        for r in range(rounds + 1):  # the first round warms up, untimed
            order = [True, False] if r % 2 else [False, True]
            for grouped in order:
                rate = round_(root, durability, grouped, threads, n, seed=r)
                if r:
                    seen["grouped" if grouped else "one_by_one"].append(rate)
        grouped, alone = (statistics.median(seen[k]) for k in ("grouped", "one_by_one"))
        rows[durability] = {
            "puts": n,
            "grouped_puts_per_s": round(grouped),
            "one_by_one_puts_per_s": round(alone),
            "ratio": round(grouped / alone, 3),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--puts", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    keep_write_buffers()  # as `prefixd serve` runs (prefixd.store.allocator)
    root = Path(tempfile.mkdtemp(prefix="prefixd-commits-", dir=args.dir))
    try:
        rows = measure(root, args.threads, args.puts, args.rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "threads": args.threads,
        "block_bytes": BLOCK_BYTES,
        "rows": rows,
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
    }
    if args.json:
        print(json.dumps(report))
        return
    for durability, row in rows.items():
        print(
            f"{durability:8} {args.threads} threads: grouped {row['grouped_puts_per_s']:>7} puts/s, "
            f"one by one {row['one_by_one_puts_per_s']:>7} puts/s, ratio {row['ratio']}"
        )


if __name__ == "__main__":
    main()
