"""One blocking client timing lookups for `bench/ab.py --clients`: whichever `prefixd` is first
on PYTHONPATH is the client measured, against a daemon someone else started.

It uses only what every revision's client offers (`Client(path)`, `Client.lookup`, `Identity`), so
a checkout of an older revision can be measured with it. Protocol on stdin/stdout, one line each:
the parent writes a count N, the worker runs N lookups of the prompt and answers with a JSON list
of their latencies in microseconds; an empty line (or EOF) ends it.

    PYTHONPATH=/path/to/other/tree python bench/lookup_worker.py SOCKET TOKENS.npy BLOCKS
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
from benchlib import bench_identity

import prefixd
from prefixd.client import Client

LOOKUP_BLOCK_TOKENS = 512
LOOKUP_PAYLOAD_BYTES = 4096


def main() -> int:
    socket_path, tokens_path, expected = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
    tokens = np.load(tokens_path)
    ident = bench_identity(LOOKUP_BLOCK_TOKENS, LOOKUP_PAYLOAD_BYTES)
    prompts = [tokens]
    clock = time.perf_counter
    print(json.dumps({"prefixd": str(Path(prefixd.__file__).parent)}), flush=True)
    with Client(socket_path) as client:
        for line in sys.stdin:
            if not line.strip():
                break
            gc.collect()
            times = []
            for _ in range(int(line)):
                started = clock()
                result = client.lookup(ident, prompts)
                times.append((clock() - started) * 1e6)
                if result[0].n_blocks != expected:
                    raise RuntimeError(f"lookup found {result[0].n_blocks} of {expected} blocks")
            print(json.dumps(times), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
