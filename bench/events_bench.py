"""What KV events cost and what they buy, measured in one run.

* put throughput with events on (every tenant published, token ids included, a subscriber
  reading everything) against off: daemons side by side, the same puts, rounds interleaved
  (each daemon first in turn), medians of puts of 16 blocks of 64 KiB (many small commits: the
  events' per-commit cost shows), and the daemons' own CPU time per block; a second daemon
  without events measures the noise floor (two alike daemons differ by that much);
* the cache-aware router of examples/router.py (events -> a prefix index per node -> the score
  prefill saved - queue - load) against pure affinity and round robin on 3 local daemons and a
  hot-spot workload: token hit rate, load skew (the busiest node's work over the mean), the
  busiest node's share, and the queue wait.

    python bench/events_bench.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from benchlib import Samples, bench_identity, timed
from suitelib import SuiteDaemon, machine_info, ratio

from prefixd.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import router

BLOCK_BYTES = 64 << 10
BLOCKS_PER_PUT = 16


def put_round(client: Client, seed: int, puts: int, payloads: list[bytes]) -> None:
    ident = bench_identity(16, BLOCK_BYTES)
    rng = np.random.default_rng(seed)
    for _ in range(puts):
        tokens = rng.integers(1, 1 << 30, BLOCKS_PER_PUT * 16, dtype=np.uint32)
        if client.put(ident, tokens, payloads).stored != BLOCKS_PER_PUT:
            raise RuntimeError("a put stored fewer blocks than it was given")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def put_cost(root: Path, *, puts: int, rounds: int) -> dict[str, Any]:
    sock = Path(tempfile.mkdtemp(prefix="pxe-"))
    events = [
        "--kv-events-endpoint", f"ipc://{sock}/events", "--kv-events-tenants", "*",
    ]  # fmt: skip
    payloads = [os.urandom(BLOCK_BYTES) for _ in range(BLOCKS_PER_PUT)]
    samples = Samples()
    received = [0]
    stop = threading.Event()
    with (
        SuiteDaemon(root, "off") as off,
        SuiteDaemon(root, "on", extra=events) as on,
        SuiteDaemon(root, "off2") as off2,  # the noise floor: a second daemon without events
        Client(off.socket, region_bytes=64 << 20, timeout=300) as c_off,
        Client(on.socket, region_bytes=64 << 20, timeout=300) as c_on,
        Client(off2.socket, region_bytes=64 << 20, timeout=300) as c_off2,
    ):
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(f"ipc://{sock}/events")

        def read() -> None:  # the subscriber reads everything, as a router would
            while not stop.is_set():
                if sub.poll(50):
                    sub.recv_multipart()
                    received[0] += 1

        reader = threading.Thread(target=read)
        reader.start()
        try:
            daemons = [("off", c_off, off.pid), ("on", c_on, on.pid), ("off2", c_off2, off2.pid)]
            for round_ in range(rounds + 1):
                order = daemons[round_ % 3 :] + daemons[: round_ % 3]  # each goes first in turn
                for name, client, pid in order:
                    cpu = cpu_seconds(pid)
                    seconds, _ = timed(lambda c=client: put_round(c, round_ * 7, puts, payloads))  # noqa: B023
                    if round_:
                        samples.add(name, seconds)
                        samples.add(f"{name}_cpu", cpu_seconds(pid) - cpu)
            stats = c_on.stats()["server"]
        finally:
            stop.set()
            reader.join()
            context.destroy(linger=0)
    n_bytes = puts * BLOCKS_PER_PUT * BLOCK_BYTES
    names = ("off", "on", "off2")
    rate = {name: n_bytes / samples.median(name) / 1e9 for name in names}
    cpu = {name: samples.median(f"{name}_cpu") / (puts * BLOCKS_PER_PUT) for name in names}
    return {
        "put_gbps_events_off": round(rate["off"], 3),
        "put_gbps_events_on": round(rate["on"], 3),
        "on_vs_off": ratio(rate["on"], rate["off"]),
        # the daemon's own CPU time per stored block: what the events cost, whatever else runs
        "daemon_cpu_us_per_block_off": round(cpu["off"] * 1e6, 1),
        "daemon_cpu_us_per_block_on": round(cpu["on"] * 1e6, 1),
        "cpu_on_vs_off": ratio(cpu["on"], cpu["off"]),
        "off2_vs_off": ratio(rate["off2"], rate["off"]),  # two daemons alike: the noise
        "cpu_off2_vs_off": ratio(cpu["off2"], cpu["off"]),
        "puts_per_round": puts,
        "rounds": rounds,
        "published_events": stats.get("events.published_events", 0),
        "dropped_events": stats.get("events.dropped_events", 0),
        "batches_received": received[0],
        "seconds": {k: [round(s, 4) for s in v] for k, v in samples.seconds.items()},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--puts", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    loadavg = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pd-events-") as root:
        report: dict[str, Any] = {"puts": put_cost(Path(root), puts=args.puts, rounds=args.rounds)}
    identity = bench_identity(16, 1024, tenant="demo")
    prompts = router.hot_spot(np.random.default_rng(11), identity.block_tokens, args.requests)
    report["router"] = router.compare(3, prompts, identity, utilization=0.7)
    report["machine"] = machine_info(loadavg)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(report["puts"])
        for policy, row in report["router"].items():
            print(f"{policy:12} {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
