"""One client process of bench/limits.py's load_clients row: it loads a stored chain into its own
region, or copies the same bytes between two buffers of its own, when told to.

Protocol on stdin/stdout, one line each: the worker prints `ready` once connected and set up; then
for each line `load N`, `load N check` or `memcpy N` it runs N loads (or copies) back to back and
answers with one JSON object: {"start": t, "end": t, "seconds": [...]}, perf_counter times (the
system-wide monotonic clock, comparable between processes). `check` compares the region with the
payloads after each load, outside its time. An empty line (or EOF) ends it.

    python bench/limits_worker.py SOCKET TOKENS.npy BLOCK_BYTES SEED
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import bench_identity, same_bytes, touched_buffer
from daemon_bench import make_payload_bytes

from prefixd.client import Client

BLOCK_TOKENS = 256
REGION_SLACK_BYTES = 16 << 20


def main() -> int:
    socket_path, tokens_path = Path(sys.argv[1]), Path(sys.argv[2])
    block_bytes, seed = int(sys.argv[3]), int(sys.argv[4])
    tokens = np.load(tokens_path)
    n_blocks = tokens.size // BLOCK_TOKENS
    size = n_blocks * block_bytes
    source = make_payload_bytes(size, np.random.default_rng(seed))
    dest = touched_buffer(size)
    ident = bench_identity(BLOCK_TOKENS, block_bytes)
    clock = time.perf_counter
    with Client(socket_path, region_bytes=size + REGION_SLACK_BYTES, timeout=600) as client:
        assert client.region is not None
        print("ready", flush=True)
        for line in sys.stdin:
            words = line.split()
            if not words:
                break
            kind, count, check = words[0], int(words[1]), words[2:] == ["check"]
            seconds = []
            start = clock()
            for _ in range(count):
                began = clock()
                if kind == "memcpy":
                    np.copyto(dest, source)
                    seconds.append(clock() - began)
                    continue
                with client.load(ident, tokens) as loaded:
                    seconds.append(clock() - began)
                    if loaded.n_blocks != n_blocks:
                        raise RuntimeError(f"loaded {loaded.n_blocks} of {n_blocks} blocks")
                    if check:
                        region = np.frombuffer(client.region.view, dtype=np.uint8)[:size]
                        if loaded.offsets[0] != 0 or not same_bytes(region, source):
                            raise RuntimeError("the load did not reproduce the payloads")
                        del region
            end = clock()
            print(json.dumps({"start": start, "end": end, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
