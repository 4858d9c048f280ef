"""Throughput of the daemon as ratios to the hardware, measured in the same run on the same bytes.

* load / memcpy, load / file read: daemon_bench.bench_load (a whole chain loaded into the client's
  region, verified, interleaved with memcpy into a plain buffer and into the region), then
  store_bench.read_file (payload-sized readinto of a plain file holding the same bytes, warm).
* put / file write+fsync: daemon_bench.put_all of the same payloads (runs of `run_blocks` blocks
  per put, a fresh chain every round) against a daemon started with `--durability full` (every put
  is fsynced before it is acknowledged), interleaved with store_bench.write_file (the same bytes in
  payload-sized writes to a fresh file, then fsync).

Every figure is the median of `repeat` rounds after an untimed warm-up round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import daemon_bench
import numpy as np
import store_bench
from benchlib import Samples, bench_identity, gbps, same_bytes, split, timed, touched_buffer
from suitelib import GiB, MiB, SuiteDaemon, ratio

from prefixd.client import Client

SEED = 20240602


def measure(root: Path, *, size_bytes: int, block_bytes: int, repeat: int, run_blocks: int) -> dict:
    n_blocks = size_bytes // block_bytes
    settings = daemon_bench.Settings(
        total_bytes=size_bytes,
        payload_bytes=block_bytes,
        n_blocks=n_blocks,
        run_blocks=run_blocks,
        repeat=repeat,
        lookups=1,
        workers=None,
        root=None,
        json=False,
        verbose=False,
    )
    rng = np.random.default_rng(SEED)
    source = daemon_bench.make_payload_bytes(size_bytes, rng)
    payloads = split(source, block_bytes)
    block_tokens = daemon_bench.LOAD_BLOCK_TOKENS
    ident = bench_identity(block_tokens, block_bytes)
    chains = [daemon_bench.make_tokens(n_blocks * block_tokens, rng) for _ in range(repeat + 1)]
    samples = Samples()
    map_size = max(8 * GiB, 4 * (repeat + 1) * size_bytes)
    daemon = SuiteDaemon(root, "ratios", map_size=map_size, extra=["--durability", "full"])
    file_path = root / "ratios" / "plain.bin"
    with daemon, Client(daemon.socket, region_bytes=size_bytes + 16 * MiB, timeout=300) as client:
        for round_, tokens in enumerate(chains):
            seconds, stored = timed(
                lambda tokens=tokens: daemon_bench.put_all(
                    client, ident, tokens, payloads, run_blocks
                )
            )
            if stored != n_blocks:
                raise RuntimeError(f"put stored {stored} of {n_blocks} blocks")
            file_path.unlink(missing_ok=True)
            file_seconds, _ = timed(lambda: store_bench.write_file(file_path, payloads))
            if round_:
                samples.add("put", seconds)
                samples.add("file_write", file_seconds)
        daemon_bench.bench_load(settings, client, ident, chains[-1], source, samples)
        dest = touched_buffer(size_bytes)
        dests = split(dest, block_bytes)
        for round_ in range(repeat + 1):
            dest.fill(0)
            seconds, got = timed(lambda: store_bench.read_file(file_path, dests))
            if got != size_bytes or (round_ == 0 and not same_bytes(dest, source)):
                raise RuntimeError("the plain file read did not reproduce the payloads")
            if round_:
                samples.add("file_read", seconds)
    rate = {name: gbps(size_bytes, samples.median(name)) for name in samples.seconds}
    report: dict[str, Any] = {name + "_gbps": round(value, 3) for name, value in rate.items()}
    report.update(
        {
            "load_vs_memcpy": ratio(rate["load"], rate["memcpy"]),
            "load_vs_memcpy_region": ratio(rate["load"], rate["memcpy_region"]),
            "load_vs_file_read": ratio(rate["load"], rate["file_read"]),
            "put_vs_file_write": ratio(rate["put"], rate["file_write"]),
            "verified": True,  # every timed load was compared byte for byte with the payloads
            "settings": {
                "bytes": size_bytes,
                "block_bytes": block_bytes,
                "blocks": n_blocks,
                "block_tokens": block_tokens,
                "run_blocks": run_blocks,
                "repeat": repeat,
                "daemon_durability": "full",
            },
            "seconds": {k: [round(s, 4) for s in v] for k, v in samples.seconds.items()},
        }
    )
    return report
