"""The write-behind, on and off, on the same bytes in one run: puts of `--size-mib` of 1 MiB
payloads in runs of 64 (as store_bench puts them, then one fsync) through a store whose
write-behind starts the disk writes (every 32 MiB committed under `periodic`, all along each large
commit under `full`), through the same store with it off, and a plain file write+fsync of the same
bytes; the three take turns, each round in another order, and the ratios are taken round by round
(median, spread).

    python bench/write_behind_ab.py --rounds 7 --size-mib 1024 --dir /var/tmp
    python bench/write_behind_ab.py --rounds 7 --size-mib 1024 --dir /var/tmp --durability full
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import store_bench
from benchlib import bench_identity, split, timed

from prefixd.store import write_behind
from prefixd.store.allocator import keep_write_buffers


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--durability", choices=("periodic", "full"), default="periodic")
    args = parser.parse_args()
    keep_write_buffers()  # as `prefixd serve` runs
    settings = store_bench.parse_args(
        ["--size-mib", str(args.size_mib), "--durability", args.durability]
    )
    rng = np.random.default_rng(store_bench.SEED)
    source = store_bench.make_payload_bytes(settings.total_bytes, "bf16", rng)
    payloads = split(source, settings.payload_bytes)
    tokens = store_bench.make_tokens(settings.n_blocks, rng)
    ident = bench_identity(store_bench.BLOCK_TOKENS, settings.payload_bytes)
    work = Path(tempfile.mkdtemp(prefix="prefixd-wb-", dir=args.dir))
    kick = write_behind.WriteBehind._kick

    def put(on: bool) -> float:
        write_behind.WriteBehind._kick = kick if on else (lambda self: None)  # type: ignore[method-assign]
        path = work / "store"
        shutil.rmtree(path, ignore_errors=True)
        with store_bench.open_store(path, settings) as store:
            return timed(
                lambda: store_bench.put_all(store, ident, tokens, payloads, settings.run_blocks)
            )[0]

    def plain_file() -> float:
        path = work / "plain.bin"
        path.unlink(missing_ok=True)
        return timed(lambda: store_bench.write_file(path, payloads))[0]

    measures: list[tuple[str, Callable[[], float]]] = [
        ("write_behind", lambda: put(True)),
        ("without", lambda: put(False)),
        ("file_write", plain_file),
    ]
    seconds: dict[str, list[float]] = {}
    try:
        for round_ in range(args.rounds + 1):  # the first is a warm-up
            turn = measures[round_ % 3 :] + measures[: round_ % 3]
            took = {name: run() for name, run in turn}
            if round_:
                for name, value in took.items():
                    seconds.setdefault(name, []).append(value)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ratio(reference: str, measured: str) -> dict[str, float]:
        each = [r / m for r, m in zip(seconds[reference], seconds[measured], strict=True)]
        return {"median": round(statistics.median(each), 3), "min": round(min(each), 3),
                "max": round(max(each), 3)}  # fmt: skip

    gbps = {
        k: round(settings.total_bytes / statistics.median(v) / 1e9, 3) for k, v in seconds.items()
    }
    report = {
        "gbps": gbps,
        "write_behind_vs_without": ratio("without", "write_behind"),
        "write_behind_vs_file_write": ratio("file_write", "write_behind"),
        "without_vs_file_write": ratio("file_write", "without"),
        "seconds": {k: [round(s, 3) for s in v] for k, v in seconds.items()},
        "size_mib": args.size_mib,
        "durability": args.durability,
        "machine": store_bench.machine_info(),
    }
    json.dump(report, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
