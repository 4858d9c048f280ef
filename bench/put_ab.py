"""What each of the put's overlaps gives, on the same bytes in one run: puts of `--size-mib` of
1 MiB payloads in runs of 64 (as store_bench puts them, then one fsync) through the store as it
runs (`put`), through the same store with one overlap taken away, and a plain file write+fsync of
the same bytes. The overlaps:

* write-behind: the disk writes of data.mdb started every 32 MiB committed under `periodic`, all
  along each large commit under `full` (`no_write_behind` takes it away);
* checksums aside: a large raw put's crc32c taken on the pool while its transaction copies the
  payloads into LMDB (`checksums_first` takes them before the transaction, half on each core).

The measures take turns, each round in another order, and the ratios are taken round by round
(median, spread).

    python bench/put_ab.py --rounds 7 --size-mib 1024 --dir /var/tmp
    python bench/put_ab.py --rounds 7 --size-mib 1024 --dir /var/tmp --durability full
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from pathlib import Path

import numpy as np
import store_bench
from benchlib import bench_identity, removed, split, timed

from prefixd.store import write_behind
from prefixd.store.allocator import keep_write_buffers
from prefixd.store.codec import EncodedPayload, PayloadCodec


def _checksums_first(
    codec: PayloadCodec, payloads: Sequence[memoryview], pool: Executor
) -> list[EncodedPayload]:
    """The checksums taken before the transaction: the first half here, the second on the pool."""
    half = len(payloads) // 2
    tail = pool.submit(lambda: [codec.encode(p) for p in payloads[half:]])
    return [codec.encode(p) for p in payloads[:half]] + tail.result()


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
    work = Path(tempfile.mkdtemp(prefix="prefixd-put-ab-", dir=args.dir))
    kick = write_behind.WriteBehind._kick
    aside = PayloadCodec._checksummed_aside

    def put(*, behind: bool = True, checksums_aside: bool = True) -> float:
        write_behind.WriteBehind._kick = kick if behind else (lambda self: None)  # type: ignore[method-assign]
        PayloadCodec._checksummed_aside = aside if checksums_aside else _checksums_first  # type: ignore[method-assign]
        path = work / "store"
        removed(path)
        with store_bench.open_store(path, settings) as store:
            return timed(
                lambda: store_bench.put_all(store, ident, tokens, payloads, settings.run_blocks)
            )[0]

    def plain_file() -> float:
        path = work / "plain.bin"
        removed(path)
        return timed(lambda: store_bench.write_file(path, payloads))[0]

    measures: list[tuple[str, Callable[[], float]]] = [
        ("put", put),
        ("no_write_behind", lambda: put(behind=False)),
        ("checksums_first", lambda: put(checksums_aside=False)),
        ("file_write", plain_file),
    ]
    seconds: dict[str, list[float]] = {}
    try:
        for round_ in range(args.rounds + 1):  # the first is a warm-up
            turn = measures[round_ % len(measures) :] + measures[: round_ % len(measures)]
            took = {name: run() for name, run in turn}
            print(f"round {round_}: {took}", file=sys.stderr)
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
        "put_vs_file_write": ratio("file_write", "put"),
        "put_vs_no_write_behind": ratio("no_write_behind", "put"),
        "put_vs_checksums_first": ratio("checksums_first", "put"),
        "no_write_behind_vs_file_write": ratio("file_write", "no_write_behind"),
        "checksums_first_vs_file_write": ratio("file_write", "checksums_first"),
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
