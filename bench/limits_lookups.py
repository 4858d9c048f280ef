"""The latency rows of bench/limits.py: lookup (against a blocking Unix-socket echo round trip in
the same run) and lookup_scale (a store of 1M entries against one of 1K, bench/scale.py)."""

from __future__ import annotations

import gc
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import scale
from benchlib import bench_identity
from daemon_bench import (
    LOOKUP_BLOCK_TOKENS,
    LOOKUP_PAYLOAD_BYTES,
    LOOKUP_PROMPT_TOKENS,
    HelloPinger,
    lookup_payloads,
    make_tokens,
    put_all,
)
from limitlib import Preset, Target, ratio_of, rotated, row
from suitelib import SuiteDaemon, percentiles_us

from prefixd.client import Client

ECHO_BYTES = 64  # about a `hello` frame


class Echo:
    """A thread answering each message on a Unix socket with the same bytes, and a blocking
    client of it: the round trip a request cannot beat (two syscalls each way, two wake-ups)."""

    def __init__(self) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="pxd-echo-")
        path = str(Path(self._dir.name) / "echo.sock")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(1)
        self._thread = threading.Thread(target=self._serve, args=(listener,), daemon=True)
        self._thread.start()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self._message = bytes(range(ECHO_BYTES))
        self._reply = bytearray(ECHO_BYTES)

    @staticmethod
    def _serve(listener: socket.socket) -> None:
        conn, _ = listener.accept()
        listener.close()
        with conn:
            buffer = bytearray(1 << 16)
            while got := conn.recv_into(buffer):
                conn.sendall(memoryview(buffer)[:got])

    def __call__(self) -> int:
        self.sock.sendall(self._message)
        view, got = memoryview(self._reply), 0
        while got < ECHO_BYTES:
            n = self.sock.recv_into(view[got:])
            if not n:
                raise RuntimeError("the echo thread closed its socket")
            got += n
        return got

    def close(self) -> None:
        self.sock.close()
        self._thread.join(10)
        self._dir.cleanup()


def lookup(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    """`Client.lookup` of a 131072-token prompt of 512-token blocks, all stored, and `hello` on a
    second connection, against the echo round trip; the three interleaved, rotating their order,
    after a warm-up."""
    ident = bench_identity(LOOKUP_BLOCK_TOKENS, LOOKUP_PAYLOAD_BYTES)
    tokens = make_tokens(LOOKUP_PROMPT_TOKENS, rng)
    n = LOOKUP_PROMPT_TOKENS // LOOKUP_BLOCK_TOKENS
    with SuiteDaemon(root, "lookup") as daemon, Client(daemon.socket, region_bytes=8 << 20) as c:
        if put_all(c, ident, tokens, lookup_payloads(n, rng), 64) != n:
            raise RuntimeError("the lookup prompt was not stored whole")
        hello = HelloPinger(daemon.socket)
        echo = Echo()
        try:
            hello()  # a connection's first request must be hello
            prompts = [tokens]
            actions: dict[str, Callable[[], Any]] = {
                "lookup": lambda: c.lookup(ident, prompts)[0].n_blocks,
                "hello": hello,
                "echo": echo,
            }
            times: dict[str, list[float]] = {name: [] for name in actions}
            clock = time.perf_counter
            gc.collect()
            for i in range(preset.lookup_warmup + preset.lookups):
                for name in rotated(list(actions), i):
                    started = clock()
                    result = actions[name]()
                    elapsed = clock() - started
                    if name == "lookup" and result != n:
                        raise RuntimeError(f"the lookup found {result} of {n} blocks")
                    if i >= preset.lookup_warmup:
                        times[name].append(elapsed)
        finally:
            hello.close()
            echo.close()
    us = {name: percentiles_us(values) for name, values in times.items()}
    return row(
        "us",
        {
            "p50_us": us["lookup"]["p50"],
            "p99_us": us["lookup"]["p99"],
            "hello_p50_us": us["hello"]["p50"],
            "hello_p99_us": us["hello"]["p99"],
        },
        {"echo_p50_us": us["echo"]["p50"], "echo_p99_us": us["echo"]["p99"]},
        {
            "p50_vs_echo": ratio_of(us["lookup"]["p50"], us["echo"]["p50"]),
            "p99_vs_echo": ratio_of(us["lookup"]["p99"], us["echo"]["p99"]),
            "hello_p50_vs_echo": ratio_of(us["hello"]["p50"], us["echo"]["p50"]),
        },
        [Target("measure.p50_us", "<=", 120.0), Target("measure.p99_us", "<=", 1000.0)],
        settings={
            "prompt_tokens": LOOKUP_PROMPT_TOKENS,
            "block_tokens": LOOKUP_BLOCK_TOKENS,
            "blocks": n,
            "lookups": preset.lookups,
            "warmup": preset.lookup_warmup,
            "echo_bytes": ECHO_BYTES,
        },
    )


def lookup_scale(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    """bench/scale.py's measure: the two stores written with the library (chains of tiny payloads,
    a transaction per chain), both daemons up, their lookups interleaved."""
    del rng  # scale.py draws its own chains from its own seed
    started = time.perf_counter()
    report = scale.measure(
        root,
        large_entries=preset.scale_entries,
        lookups=preset.scale_lookups,
        warmup=preset.scale_warmup,
    )
    small, large = report["small"], report["large"]
    return row(
        "us",
        {
            "large_p50_us": large["lookup_us"]["p50"],
            "large_p99_us": large["lookup_us"]["p99"],
        },
        {
            "small_p50_us": small["lookup_us"]["p50"],
            "small_p99_us": small["lookup_us"]["p99"],
        },
        {
            "p50": ratio_of(large["lookup_us"]["p50"], small["lookup_us"]["p50"]),
            "p99": ratio_of(large["lookup_us"]["p99"], small["lookup_us"]["p99"]),
        },
        [Target("ratio.p50", "<=", 1.2)],
        entries={"large": large["entries"], "small": small["entries"]},
        build_s={"large": large["build_s"], "small": small["build_s"]},
        start_s={"large": large["start_s"], "small": small["start_s"]},
        row_s=round(time.perf_counter() - started, 1),
        settings=report["settings"],
    )
