"""The request round trip through the daemon, against the limits of this machine, in one run:

* echo:    a blocking Unix-socket round trip of a 64-byte message to an echo server in another
           process (a plain `recv_into` / `sendall` loop): the floor for any request/reply.
           Where the scheduler puts the two ends decides it: on this VM a round trip within one
           vCPU is a few times faster than one across two (guest halt-polling is off, so each
           wake of an idle vCPU costs tens of microseconds). `echo_pinned` reports both,
           measured after the interleaved rounds with each end pinned (2 CPUs or more).
* hello:   the `hello` request on a bare protocol connection (daemon_bench.HelloPinger): socket,
           event loop and frame handling, no pool and no store.
* lookup:  `Client.lookup` of one 131,072-token prompt of 512-token blocks (256 blocks, all
           stored), the blocking client with its default reply polling (`poll_us`; see
           prefixd.client.polling), and `lookup_sleeping` with poll_us=0 on a second
           connection; echo, hello and both lookups interleaved.
* scale:   the lookup p50 of a store of `--scale-entries` entries over one of 1,000
           (bench/scale.py; skipped with `--scale-entries 0`).

Each figure comes with its target and the ratio figure / target (<= 1 meets it): lookup p50
<= 120 us and p99 <= 1 ms, scale p50 <= 1.2; hello and echo are reported as multiples of the
echo floor measured in the same run.

    python bench/roundtrip.py --json
    python bench/roundtrip.py --lookups 2000 --scale-entries 0
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import daemon_bench as db
import numpy as np

from prefixd.client import Client

DEFAULT_LOOKUPS = 3000
WARMUP = 200
ECHO_BYTES = 64
TARGET_LOOKUP_P50_US = 120.0
TARGET_LOOKUP_P99_US = 1000.0
TARGET_SCALE_P50 = 1.2
DEFAULT_SCALE_ENTRIES = 1_000_000

_ECHO_SERVER = """
import socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(1)
print("ready", flush=True)
conn, _ = listener.accept()
buffer = memoryview(bytearray(65536))
while True:
    n = conn.recv_into(buffer)
    if not n:
        break
    conn.sendall(buffer[:n])
"""


def _pinned_echo(echo: Echo, server_cpu: int, client_cpu: int, rounds: int) -> float:
    """p50 microseconds of echo round trips with the server pinned to one CPU and this thread
    to another (or the same); both affinities are restored after."""
    server_was = os.sched_getaffinity(echo.server.pid)
    ours_was = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(echo.server.pid, {server_cpu})
        os.sched_setaffinity(0, {client_cpu})
        clock = time.perf_counter
        samples = []
        for i in range(WARMUP + rounds):
            started = clock()
            echo()
            if i >= WARMUP:
                samples.append(clock() - started)
    finally:
        os.sched_setaffinity(echo.server.pid, server_was)
        os.sched_setaffinity(0, ours_was)
    return _percentiles(samples)["p50"]


def wake(echo: Echo, rounds: int) -> dict[str, float] | None:
    """The echo round trip within one CPU and across two: what waking a sleeping peer on
    another CPU adds to every request (None with fewer than 2 usable CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    same = _pinned_echo(echo, cpus[0], cpus[0], rounds)
    across = _pinned_echo(echo, cpus[0], cpus[1], rounds)
    return {"same_cpu_p50_us": same, "cross_cpu_p50_us": across}


class Echo:
    """A blocking round trip to an echo server in another process."""

    def __init__(self, path: Path) -> None:
        self.server = subprocess.Popen(
            [sys.executable, "-c", _ECHO_SERVER, str(path)], stdout=subprocess.PIPE
        )
        assert self.server.stdout is not None
        self.server.stdout.readline()  # "ready": bound and listening
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.message = b"x" * ECHO_BYTES
        self.buffer = memoryview(bytearray(ECHO_BYTES))

    def __call__(self) -> None:
        self.sock.sendall(self.message)
        got = 0
        while got < ECHO_BYTES:
            got += self.sock.recv_into(self.buffer[got:])

    def close(self) -> None:
        self.sock.close()
        self.server.wait(10)


def _percentiles(samples: list[float]) -> dict[str, float]:
    us = np.asarray(samples) * 1e6
    return {
        "p50": round(float(np.percentile(us, 50)), 1),
        "p99": round(float(np.percentile(us, 99)), 1),
    }


def measure(lookups: int, workdir: Path, sock_dir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(db.SEED)
    ident = db.bench_identity(db.LOOKUP_BLOCK_TOKENS, db.LOOKUP_PAYLOAD_BYTES)
    tokens = db.make_tokens(db.LOOKUP_PROMPT_TOKENS, rng)
    n_blocks = db.LOOKUP_PROMPT_TOKENS // db.LOOKUP_BLOCK_TOKENS
    payloads = db.lookup_payloads(n_blocks, rng)
    settings = db.parse_args(["--size-mib", "1", "--block-kib", "1024"])
    daemon = db.Daemon(workdir / "data", sock_dir, settings)
    echo = Echo(sock_dir / "echo.sock")
    try:
        daemon.start()
        with (
            Client(daemon.socket, region_bytes=16 << 20) as client,
            Client(daemon.socket, poll_us=0) as sleeper,
        ):
            if db.put_all(client, ident, tokens, payloads, 64) != n_blocks:
                raise RuntimeError("the lookup chain was not stored whole")
            hello = db.HelloPinger(daemon.socket)
            try:
                hello()  # greets
                prompts = [tokens]

                def lookup(through: Client) -> Callable[[], None]:
                    def go() -> None:
                        if through.lookup(ident, prompts)[0].n_blocks != n_blocks:
                            raise RuntimeError("the lookup missed stored blocks")

                    return go

                actions: dict[str, Callable[[], Any]] = {
                    "echo": echo,
                    "hello": hello,
                    "lookup": lookup(client),
                    "lookup_sleeping": lookup(sleeper),
                }
                times: dict[str, list[float]] = {name: [] for name in actions}
                names = list(actions)
                clock = time.perf_counter
                gc.collect()
                for i in range(WARMUP + lookups):
                    shift = i % len(names)
                    for name in names[shift:] + names[:shift]:
                        started = clock()
                        actions[name]()
                        if i >= WARMUP:
                            times[name].append(clock() - started)
                waits = client.reply_waits
                woken = wake(echo, lookups)
            finally:
                hello.close()
    finally:
        echo.close()
        if daemon.stop() != 0:
            raise RuntimeError(f"the daemon did not stop cleanly{daemon.tail()}")
    out: dict[str, Any] = {name: _percentiles(values) for name, values in times.items()}
    out["reply_waits"] = waits
    out["wake"] = woken
    return out


def report(latency: dict[str, Any], scale_ratio: float | None, lookups: int) -> dict[str, Any]:
    echo = latency["echo"]
    out: dict[str, Any] = {
        "echo_p50_us": echo["p50"],
        "echo_p99_us": echo["p99"],
        "hello_p50_us": latency["hello"]["p50"],
        "hello_p99_us": latency["hello"]["p99"],
        "hello_p50_vs_echo": round(latency["hello"]["p50"] / echo["p50"], 2),
        "hello_p99_vs_echo": round(latency["hello"]["p99"] / echo["p99"], 2),
        "lookup_p50_us": latency["lookup"]["p50"],
        "lookup_p99_us": latency["lookup"]["p99"],
        "lookup_p50_vs_target": round(latency["lookup"]["p50"] / TARGET_LOOKUP_P50_US, 2),
        "lookup_p99_vs_target": round(latency["lookup"]["p99"] / TARGET_LOOKUP_P99_US, 2),
        "lookup_p50_vs_echo": round(latency["lookup"]["p50"] / echo["p50"], 2),
        "lookup_sleeping_p50_us": latency["lookup_sleeping"]["p50"],
        "lookup_sleeping_p99_us": latency["lookup_sleeping"]["p99"],
        "lookup_reply_waits": latency["reply_waits"],
        "echo_pinned": latency["wake"],
        "scale_lookup_p50_ratio": scale_ratio,
        "scale_vs_target": None
        if scale_ratio is None
        else round(scale_ratio / TARGET_SCALE_P50, 2),
        "targets": {
            "lookup_p50_us": TARGET_LOOKUP_P50_US,
            "lookup_p99_us": TARGET_LOOKUP_P99_US,
            "scale_lookup_p50_ratio": TARGET_SCALE_P50,
        },
        "settings": {
            "lookups": lookups,
            "warmup": WARMUP,
            "prompt_tokens": db.LOOKUP_PROMPT_TOKENS,
        },
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--lookups", type=int, default=DEFAULT_LOOKUPS, help="timed round trips")
    parser.add_argument(
        "--scale-entries",
        type=int,
        default=DEFAULT_SCALE_ENTRIES,
        help="entries of the large store of the scale ratio (0: skip it)",
    )
    args = parser.parse_args(argv)
    import shutil

    import scale

    workdir = Path(tempfile.mkdtemp(prefix="prefixd-rtt-"))
    sock_dir = Path(tempfile.mkdtemp(prefix="pxd-"))
    try:
        latency = measure(args.lookups, workdir, sock_dir)
        ratio = None
        if args.scale_entries:
            scaled = scale.measure(
                workdir / "scale", large_entries=args.scale_entries, lookups=1000, warmup=100
            )
            ratio = scaled["ratios_large_to_small"]["lookup_p50"]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
    out = report(latency, ratio, args.lookups)
    if args.json:
        print(json.dumps(out))
    else:
        for key, value in out.items():
            if key not in ("targets", "settings"):
                print(f"  {key:<24} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
