"""The write rows of bench/limits.py: put_chain, put_roots, put_64 and durable_put, each against
raw LMDB (py-lmdb directly, the store's map settings) or a plain file, in the same run.

Blocks are 16 KiB of bf16 normals (1 MiB for durable_put) of `BLOCK_TOKENS` tokens each (a paged
engine's block). Every store, LMDB environment and file is fresh for each round; the first round
is an untimed warm-up."""

from __future__ import annotations

import gc
import os
import select
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import bench_identity, split
from daemon_bench import make_payload_bytes
from limitlib import (
    MAP_SIZE,
    FileSyncer,
    Preset,
    RawLmdb,
    Target,
    interleaved,
    median,
    per_second,
    ratio_of,
    rotated,
    row,
)
from suitelib import SuiteDaemon

from prefixd import Store
from prefixd.client import Client

BLOCK_BYTES = 16 << 10
BLOCK_TOKENS = 16
RUN_BLOCKS = 64
DURABLE_BLOCK_BYTES = 1 << 20
DISTINCT_PAYLOADS = 64  # payloads are reused in turn: their bytes do not change a put's cost
VOCAB = 128_000
SYNC_INTERVAL_S = 1.0  # the store's default under `periodic`
WAIT_S = 0.0004  # put_roots: about what a daemon's loop waits between a sequential client's puts


def _payloads(rng: np.random.Generator, size: int, count: int = DISTINCT_PAYLOADS) -> list[Any]:
    return split(make_payload_bytes(size * count, rng), size)


def _tokens(rng: np.random.Generator, n_blocks: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n_blocks * BLOCK_TOKENS, dtype=np.uint32)


def _keys(rng: np.random.Generator, count: int) -> list[bytes]:
    return [rng.bytes(32) for _ in range(count)]


def _store(path: Path, durability: str = "periodic") -> Store:
    return Store.open(
        path, map_size=MAP_SIZE, durability=durability, sync_interval_s=SYNC_INTERVAL_S
    )


def _expect(stored: int, wanted: int, what: str) -> None:
    if stored != wanted:
        raise RuntimeError(f"{what} stored {stored} of {wanted} blocks")


# --- put_chain -------------------------------------------------------------------------------


def put_chain(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    """One block per put, each extending the chain (first_block = k), against one raw LMDB
    transaction per block; the two alternate put by put (who goes first alternating too). The
    slope is a least-squares line through the per-k medians of the put times."""
    n = preset.chain_blocks
    ident = bench_identity(BLOCK_TOKENS, BLOCK_BYTES)
    payloads = _payloads(rng, BLOCK_BYTES)
    names = ("library", "raw_lmdb")
    times = {name: np.zeros((preset.repeat, n)) for name in names}
    clock = time.perf_counter
    for round_ in range(1 + preset.repeat):
        tokens = _tokens(rng, n)
        keys = _keys(rng, n)
        base = root / f"chain-{round_}"
        with _store(base / "store") as store, RawLmdb(base / "raw") as raw:
            gc.collect()
            for k in range(n):
                payload = payloads[k % len(payloads)]
                prefix = tokens[: (k + 1) * BLOCK_TOKENS]
                for name in rotated(names, k + round_):
                    started = clock()
                    if name == "library":
                        stored = store.put(ident, prefix, [payload], first_block=k).stored
                    else:
                        raw.put(keys[k], payload)
                    elapsed = clock() - started
                    if name == "library":
                        _expect(stored, 1, f"put {k} of the chain")
                    if round_:
                        times[name][round_ - 1, k] = elapsed
        shutil.rmtree(base)
    per_k = {name: np.median(times[name], axis=0) for name in names}
    rate = {name: per_second(n, float(np.median(times[name].sum(axis=1)))) for name in names}
    ks = np.arange(n)
    slope = {name: float(np.polyfit(ks, per_k[name], 1)[0]) * 1e6 for name in names}
    tenth = max(1, n // 10)
    return row(
        "blocks/s",
        {"blocks_per_s": rate["library"]},
        {"puts_per_s": rate["raw_lmdb"]},
        {"blocks_per_s": ratio_of(rate["library"], rate["raw_lmdb"])},
        # extra microseconds per put per block of ancestry (a line fitted to put time against k)
        slope_us_per_block={name: round(slope[name], 4) for name in names},
        put_us={
            name: {
                "first_tenth_median": round(float(np.median(per_k[name][:tenth])) * 1e6, 1),
                "last_tenth_median": round(float(np.median(per_k[name][-tenth:])) * 1e6, 1),
            }
            for name in names
        },
        settings={"chain_blocks": n, "block_bytes": BLOCK_BYTES, "block_tokens": BLOCK_TOKENS},
    )


# --- put_roots and put_64 --------------------------------------------------------------------


def _many_roots(
    root: Path,
    name: str,
    preset: Preset,
    rng: np.random.Generator,
    puts: int,
    blocks: int,
) -> dict[str, float]:
    """Blocks per second of `puts` puts of `blocks` blocks, each a new chain from the root:
    through the library, through the daemon (blocking client), and into raw LMDB (one transaction
    per put), interleaved round by round. Tokens and keys are drawn before each timing."""
    ident = bench_identity(BLOCK_TOKENS, BLOCK_BYTES)
    payloads = _payloads(rng, BLOCK_BYTES)
    runs = [payloads[i : i + blocks] for i in range(0, len(payloads) - blocks + 1, blocks)]
    runs = runs or [(payloads * blocks)[:blocks]]
    chains: list[np.ndarray] = []
    keys: list[bytes] = []

    def draw() -> None:
        chains[:] = list(_tokens(rng, puts * blocks).reshape(puts, -1))
        keys[:] = _keys(rng, puts * blocks)

    def through(put: Callable[..., Any], label: str) -> Callable[[], None]:
        def go() -> None:
            for i, chain in enumerate(chains):
                _expect(put(ident, chain, runs[i % len(runs)]).stored, blocks, label)

        return go

    daemon = SuiteDaemon(root, name, map_size=MAP_SIZE)
    region = max(8 << 20, 4 * blocks * BLOCK_BYTES)
    with (
        daemon,
        Client(daemon.socket, region_bytes=region, timeout=300) as client,
        _store(root / name / "library") as store,
        RawLmdb(root / name / "raw") as raw,
    ):

        def raw_puts() -> None:
            for i in range(puts):
                run = runs[i % len(runs)]
                if blocks == 1:
                    raw.put(keys[i], run[0])
                else:
                    raw.put_many(list(zip(keys[i * blocks : (i + 1) * blocks], run)))

        actions = {
            "library": through(store.put, "the library put"),
            "daemon": through(client.put, "the daemon put"),
            "raw_lmdb": raw_puts,
        }
        seconds = interleaved(actions, preset.repeat, setup=dict.fromkeys(actions, draw))
    return {name: per_second(puts * blocks, median(s)) for name, s in seconds.items()}


def _after_a_wait(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, float]:
    """Median microseconds of one library put (a 16 KiB block, a new root) run back to back,
    and of the same put run right after its thread waited WAIT_S on a socket, as the daemon's
    event loop waits for a client's next request: the cost of coming back from idle (on a VM,
    a halted vCPU and cold caches), which every put through a daemon pays. Each round runs
    `root_puts` puts of each kind, the kinds in turn (who goes first alternating); only the
    puts are timed, and the first round warms up."""
    ident = bench_identity(BLOCK_TOKENS, BLOCK_BYTES)
    payloads = _payloads(rng, BLOCK_BYTES)
    names = ("back_to_back", "after_a_wait")
    times: dict[str, list[float]] = {name: [] for name in names}
    idle, peer = socket.socketpair()
    clock = time.perf_counter
    with idle, peer, _store(root / "after_a_wait") as store:
        for round_ in range(1 + preset.repeat):
            for name in rotated(names, round_):
                chains = _tokens(rng, preset.root_puts).reshape(-1, BLOCK_TOKENS)
                gc.collect()
                for i, chain in enumerate(chains):
                    if name == "after_a_wait":
                        select.select([idle], [], [], WAIT_S)  # nothing arrives: a plain wait
                    started = clock()
                    stored = store.put(ident, chain, [payloads[i % len(payloads)]]).stored
                    elapsed = clock() - started
                    _expect(stored, 1, "a put")
                    if round_:
                        times[name].append(elapsed)
    return {name: round(float(np.median(t)) * 1e6, 1) for name, t in times.items()}


def put_roots(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    rate = _many_roots(root, "put_roots", preset, rng, preset.root_puts, 1)
    return row(
        "puts/s",
        {"library": rate["library"], "daemon": rate["daemon"]},
        {"raw_lmdb": rate["raw_lmdb"]},
        {
            "library": ratio_of(rate["library"], rate["raw_lmdb"]),
            "daemon": ratio_of(rate["daemon"], rate["raw_lmdb"]),
        },
        [Target("ratio.daemon", ">=", 0.5)],
        library_put_us=_after_a_wait(root, preset, rng),
        settings={"puts": preset.root_puts, "block_bytes": BLOCK_BYTES, "wait_s": WAIT_S},
    )


def put_64(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    rate = _many_roots(root, "put_64", preset, rng, preset.put64_puts, RUN_BLOCKS)
    return row(
        "blocks/s",
        {"daemon": rate["daemon"], "library": rate["library"]},
        {"raw_lmdb": rate["raw_lmdb"]},
        {
            "daemon": ratio_of(rate["daemon"], rate["raw_lmdb"]),
            "library": ratio_of(rate["library"], rate["raw_lmdb"]),
        },
        [Target("ratio.daemon", ">=", 0.6)],
        settings={"puts": preset.put64_puts, "blocks_per_put": RUN_BLOCKS},
    )


# --- durable_put -----------------------------------------------------------------------------


def _write_all(path: Path, payloads: list[Any], count: int, *, fsync_each: bool) -> None:
    """Append `count` payloads to a fresh file: an fsync after each (the `full` floor), or one
    every SYNC_INTERVAL_S on a thread and one at the end (the `periodic` floor)."""
    path.unlink(missing_ok=True)  # a new file, as the store's is: no truncation of the last one
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with FileSyncer(fd, 3600.0 if fsync_each else SYNC_INTERVAL_S):
            for i in range(count):
                view = memoryview(payloads[i % len(payloads)])
                while view.nbytes:
                    view = view[os.write(fd, view) :]
                if fsync_each:
                    os.fsync(fd)
            os.fsync(fd)
    finally:
        os.close(fd)


def _durable_round(
    root: Path,
    preset: Preset,
    durability: str,
    count: int,
    rng: np.random.Generator,
    payloads: list[Any],
) -> dict[str, float]:
    """`count` 1 MiB puts (each a new root) into a fresh store, then a sync, against the same
    bytes into a fresh plain file; the store is opened and removed outside the timing."""
    ident = bench_identity(BLOCK_TOKENS, DURABLE_BLOCK_BYTES)
    path = root / f"durable-{durability}"
    opened: list[Store] = []
    chains: list[np.ndarray] = []

    def open_store() -> None:
        opened.append(_store(path, durability))
        chains[:] = list(_tokens(rng, count).reshape(count, -1))

    def library() -> None:
        store = opened[-1]
        for i, chain in enumerate(chains):
            _expect(store.put(ident, chain, [payloads[i % len(payloads)]]).stored, 1, "a put")
        store.sync()

    def close_store() -> None:
        opened.pop().close()
        shutil.rmtree(path)

    def plain_file() -> None:
        _write_all(path.with_suffix(".bin"), payloads, count, fsync_each=durability == "full")

    seconds = interleaved(
        {"library": library, "plain_file": plain_file},
        preset.repeat,
        setup={"library": open_store},
        teardown={"library": close_store},
    )
    return {name: per_second(count, median(s)) for name, s in seconds.items()}


def durable_put(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    payloads = _payloads(rng, DURABLE_BLOCK_BYTES, 16)
    full = _durable_round(root, preset, "full", preset.durable_full_puts, rng, payloads)
    periodic = _durable_round(root, preset, "periodic", preset.durable_periodic_puts, rng, payloads)
    return row(
        "puts/s",
        {"full": full["library"], "periodic": periodic["library"]},
        {"full": full["plain_file"], "periodic": periodic["plain_file"]},
        {
            "full": ratio_of(full["library"], full["plain_file"]),
            "periodic": ratio_of(periodic["library"], periodic["plain_file"]),
        },
        [Target("ratio.full", ">=", 0.8), Target("ratio.periodic", ">=", 0.8)],
        limit_is={
            "full": "1 MiB write + fsync per put, to a fresh file",
            "periodic": f"1 MiB writes, an fsync every {SYNC_INTERVAL_S} s and one at the end",
        },
        settings={
            "block_bytes": DURABLE_BLOCK_BYTES,
            "full_puts": preset.durable_full_puts,
            "periodic_puts": preset.durable_periodic_puts,
        },
    )
