"""When a put's encoding goes to a second thread: the store's rule against always handing it over.

A put encodes its payloads (chunks and crc32c; zstd too when compressing) before its write
transaction, and `PayloadCodec.encode_many` hands the second half to the store's pool only when
there is enough work to pay for waking a thread (`codec.POOL_MIN_RAW_BYTES` of raw payloads).
This bench times puts of `--blocks` raw payloads of `--block-kib` each into one library store,
alternately under that rule and with every put's second half handed over (the threshold set to 0,
as the store did before), for `--rounds` timed rounds after an untimed one; blocks/s are the
medians. `inline_vs_pool` above 1 means the rule is faster for puts of that size on this machine.

    python bench/encode_pool.py --json
    python bench/encode_pool.py --blocks 8 --block-kib 1024 --puts 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import bench_identity, split
from daemon_bench import make_payload_bytes
from limitlib import MAP_SIZE

from prefixd import Store
from prefixd.store import codec

BLOCK_TOKENS = 16


def measure(blocks: int, block_kib: int, puts: int, rounds: int) -> dict[str, Any]:
    block_bytes = block_kib << 10
    rng = np.random.default_rng(11)
    ident = bench_identity(BLOCK_TOKENS, block_bytes)
    payloads = split(make_payload_bytes(blocks * block_bytes, rng), block_bytes)
    rule = codec.POOL_MIN_RAW_BYTES
    thresholds = {"rule": rule, "always_pool": 0}
    rates: dict[str, list[float]] = {name: [] for name in thresholds}
    with tempfile.TemporaryDirectory(prefix="prefixd-encode-pool-") as tmp:  # noqa: SIM117
        with Store.open(Path(tmp) / "store", map_size=MAP_SIZE) as store:
            try:
                for round_ in range(1 + rounds):
                    names = list(thresholds)
                    for name in names if round_ % 2 == 0 else names[::-1]:
                        codec.POOL_MIN_RAW_BYTES = thresholds[name]
                        chains = rng.integers(0, 128_000, (puts, blocks * BLOCK_TOKENS))
                        started = time.perf_counter()
                        for tokens in chains.astype(np.uint32):
                            if store.put(ident, tokens, payloads).stored != blocks:
                                raise RuntimeError("a put stored fewer blocks than it was given")
                        if round_:
                            rates[name].append(puts * blocks / (time.perf_counter() - started))
            finally:
                codec.POOL_MIN_RAW_BYTES = rule
    medians = {name: round(statistics.median(r)) for name, r in rates.items()}
    return {
        "blocks_per_s": medians,
        "inline_vs_pool": round(medians["rule"] / medians["always_pool"], 3),
        "rule_hands_over": blocks * block_bytes >= rule,
        "settings": {
            "blocks": blocks,
            "block_bytes": block_bytes,
            "puts": puts,
            "rounds": rounds,
            "pool_min_raw_bytes": rule,
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--block-kib", type=int, default=16)
    parser.add_argument("--puts", type=int, default=40, help="puts per round and rule")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = measure(args.blocks, args.block_kib, args.puts, args.rounds)
    print(json.dumps(report) if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
