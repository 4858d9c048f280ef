"""The load rows of bench/limits.py: first_load, load_clients and cold_load, each against the copy
or plain-file read of the same bytes in the same run.

Blocks are 1 MiB of bf16 normals, `BLOCK_TOKENS` tokens each, published through the daemon in
runs of 64. Every load is checked: its block count and placement after each timing, its bytes
against the payloads where the row says so."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import store_bench
from benchlib import bench_identity, gbps, same_bytes, split, touched_buffer
from daemon_bench import make_payload_bytes, make_tokens, put_all
from limitlib import (
    MAP_SIZE,
    Preset,
    Target,
    median,
    minor_faults,
    ratio_of,
    resident_fraction,
    rotated,
    row,
)
from suitelib import SuiteDaemon, percentiles_us

from prefixd import Identity
from prefixd.client import Client

BLOCK_BYTES = 1 << 20
BLOCK_TOKENS = 256  # limits_worker.py's too
RUN_BLOCKS = 64
REGION_SLACK_BYTES = 16 << 20
PUT_REGION_BYTES = RUN_BLOCKS * BLOCK_BYTES + REGION_SLACK_BYTES
WORKER = Path(__file__).with_name("limits_worker.py")
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
FILES_ONLY = "--quick evicts the two files only: drop_caches empties the whole machine's page cache"


def _daemon(root: Path, name: str, size: int) -> SuiteDaemon:
    return SuiteDaemon(root, name, map_size=max(MAP_SIZE, 4 * size))


def _publish(
    daemon: SuiteDaemon, ident: Identity, chains: list[np.ndarray], payloads: list[Any]
) -> None:
    with Client(daemon.socket, region_bytes=PUT_REGION_BYTES, timeout=600) as client:
        for tokens in chains:
            stored = put_all(client, ident, tokens, payloads, RUN_BLOCKS)
            if stored != len(payloads):
                raise RuntimeError(f"put stored {stored} of {len(payloads)} blocks")


def _timed_load(client: Client, ident: Identity, tokens: np.ndarray, n_blocks: int) -> float:
    """Seconds of one load of the whole chain into the region (from offset 0), released after."""
    gc.collect()
    started = time.perf_counter()
    with client.load(ident, tokens) as loaded:
        seconds = time.perf_counter() - started
        if loaded.n_blocks != n_blocks or loaded.offsets[:1] != (0,):
            raise RuntimeError(f"load returned {loaded.n_blocks} of {n_blocks} blocks")
    return seconds


def _region_holds(client: Client, source: np.ndarray) -> bool:
    assert client.region is not None
    region = np.frombuffer(client.region.view, dtype=np.uint8)[: source.size]
    try:
        return same_bytes(region, source)
    finally:
        del region  # no view may outlive the client's region


# --- first_load ------------------------------------------------------------------------------


def first_load(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    """The first load into a fresh client's region (the daemon faults the region's pages into its
    own mapping) against the second load into the same region, round by round, a new client each
    round; the daemon's minor page faults are counted around each load."""
    size = preset.first_load_bytes
    n = size // BLOCK_BYTES
    source = make_payload_bytes(size, rng)
    tokens = make_tokens(n * BLOCK_TOKENS, rng)
    ident = bench_identity(BLOCK_TOKENS, BLOCK_BYTES)
    seconds: dict[str, list[float]] = {"first": [], "second": []}
    faults: dict[str, list[int]] = {"first": [], "second": []}
    with _daemon(root, "first_load", size) as daemon:
        _publish(daemon, ident, [tokens], split(source, BLOCK_BYTES))
        for round_ in range(1 + preset.repeat):  # round 0 also faults the store's map in
            with Client(daemon.socket, region_bytes=size + REGION_SLACK_BYTES, timeout=600) as c:
                for which in ("first", "second"):
                    before = minor_faults(daemon.pid)
                    took = _timed_load(c, ident, tokens, n)
                    if round_:
                        seconds[which].append(took)
                        faults[which].append(minor_faults(daemon.pid) - before)
                if not _region_holds(c, source):
                    raise RuntimeError("the load did not reproduce the payloads")
    rate = {which: round(gbps(size, median(s)), 3) for which, s in seconds.items()}
    return row(
        "GB/s",
        {"first_gbps": rate["first"]},
        {"second_gbps": rate["second"]},
        {"first_vs_second": ratio_of(rate["first"], rate["second"])},
        [Target("ratio.first_vs_second", ">=", 0.9)],
        daemon_minor_faults={which: int(median(f)) for which, f in faults.items()},
        region_pages=(size + REGION_SLACK_BYTES) // os.sysconf("SC_PAGE_SIZE"),
        settings={"bytes": size, "block_bytes": BLOCK_BYTES},
    )


# --- load_clients ----------------------------------------------------------------------------


class _Workers:
    """`count` limits_worker.py processes, each with its own client and region."""

    def __init__(self, count: int, socket: Path, tokens_path: Path, seed: int, log: Path) -> None:
        self._log = open(log, "ab")  # noqa: SIM115 - closed in close()
        argv = [sys.executable, str(WORKER), str(socket), str(tokens_path), str(BLOCK_BYTES)]
        self.procs = [
            subprocess.Popen(
                [*argv, str(seed)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._log,
                text=True,
            )
            for _ in range(count)
        ]
        try:
            for proc in self.procs:
                self._line(proc, "ready")
        except BaseException:
            self.close()
            raise

    def _line(self, proc: subprocess.Popen[str], expect: str | None = None) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line or (expect is not None and line != expect):
            raise RuntimeError(
                f"a load worker said {line!r} (exit {proc.poll()}); see {self._log.name}"
            )
        return line

    def ask(self, command: str) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write(command + "\n")
            proc.stdin.flush()
        return [json.loads(self._line(proc)) for proc in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None and proc.poll() is None:
                proc.stdin.write("\n")
                proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._log.close()


def load_clients(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    """N processes at once, each loading the same chain into its own region, against N processes
    each copying the same bytes between two touched buffers of its own; interleaved round by
    round. Aggregate GB/s is every process's bytes over the span from the first start to the
    last end; the latency is one load's (one copy's), over every process and round."""
    size = preset.client_bytes
    n = size // BLOCK_BYTES
    seed = int(rng.integers(1 << 31))
    source = make_payload_bytes(size, np.random.default_rng(seed))  # as the workers make it
    tokens = make_tokens(n * BLOCK_TOKENS, rng)
    base = root / "load_clients"
    measure: dict[str, float] = {}
    limit: dict[str, float] = {}
    ratio: dict[str, float | None] = {}
    with _daemon(root, "load_clients", size) as daemon:
        _publish(
            daemon, bench_identity(BLOCK_TOKENS, BLOCK_BYTES), [tokens], split(source, BLOCK_BYTES)
        )
        del source
        tokens_path = base / "tokens.npy"
        np.save(tokens_path, tokens)
        for count in preset.clients:
            workers = _Workers(count, daemon.socket, tokens_path, seed, base / "workers.log")
            try:
                workers.ask("load 1 check")  # warm-up: every region faulted in, every byte checked
                workers.ask("memcpy 1")
                rates: dict[str, list[float]] = {"load": [], "memcpy": []}
                latencies: dict[str, list[float]] = {"load": [], "memcpy": []}
                for round_ in range(preset.repeat):
                    for kind in rotated(("load", "memcpy"), round_):
                        answers = workers.ask(f"{kind} {preset.client_loads}")
                        span = max(a["end"] for a in answers) - min(a["start"] for a in answers)
                        rates[kind].append(gbps(count * preset.client_loads * size, span))
                        for answer in answers:
                            latencies[kind].extend(answer["seconds"])
            finally:
                workers.close()
            key = f"{count}_clients"
            measure[f"{key}_gbps"] = round(median(rates["load"]), 3)
            measure[f"{key}_p99_ms"] = round(percentiles_us(latencies["load"])["p99"] / 1e3, 3)
            limit[f"{key}_gbps"] = round(median(rates["memcpy"]), 3)
            limit[f"{key}_p99_ms"] = round(percentiles_us(latencies["memcpy"])["p99"] / 1e3, 3)
            ratio[key] = ratio_of(measure[f"{key}_gbps"], limit[f"{key}_gbps"])
    targets = [Target(f"ratio.{c}_clients", ">=", 0.5) for c in preset.clients if c in (4, 16)]
    return row(
        "GB/s",
        measure,
        limit,
        ratio,
        targets,
        settings={
            "clients": list(preset.clients),
            "bytes_per_load": size,
            "loads_per_round": preset.client_loads,
            "block_bytes": BLOCK_BYTES,
        },
    )


# --- cold_load -------------------------------------------------------------------------------


def _evict(paths: list[Path], use_drop_caches: bool) -> tuple[str, str | None]:
    """Take `paths` out of the page cache: the whole cache (drop_caches) when asked and permitted,
    else each file's own clean pages (fsync, then POSIX_FADV_DONTNEED). Returns the method and
    why drop_caches was not used."""
    method: str = "fadvise_dontneed"
    why: str | None = FILES_ONLY
    if use_drop_caches:  # and then each file too: drop_caches may leave some of their pages
        os.sync()
        try:
            DROP_CACHES.write_text("3\n")
        except OSError as exc:
            why = f"drop_caches not permitted ({exc.strerror}); the two files were evicted"
        else:
            method, why = "drop_caches", None
    return _fadvise_out(paths, method, why)


def _fadvise_out(paths: list[Path], method: str, why: str | None) -> tuple[str, str | None]:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return method, why


def _restart(daemon: SuiteDaemon) -> None:
    """The same store served by a fresh daemon process (which has mapped none of it)."""
    code = daemon.stop()
    if code != 0:
        raise RuntimeError(f"the daemon exited with {code} after SIGTERM{daemon.tail()}")
    daemon.notify_path.unlink(missing_ok=True)
    daemon.start()


def cold_load(root: Path, preset: Preset, rng: np.random.Generator) -> dict[str, Any]:
    """A load by a freshly started daemon, whose map holds none of the store's pages yet: with
    data.mdb in the page cache, against a readinto of a plain file in the page cache; and after
    the page cache was emptied, against a readinto of a plain file just as cold. Each round first
    loads another chain of the same size, untimed, so the client's region is already faulted in
    on the daemon's side (first_load measures that); a cold round empties the cache after that
    load (pages the daemon has mapped stay: that chain's, and the records it read), since the
    kernel's read-around on the daemon's start and that load can read megabytes beyond them.
    `resident_before_cold` says how much of each file was still cached: on a kernel that maps a
    file's large folios whole (FilePmdMapped in smaps), 2 MiB around every page the fresh daemon
    touched stays, so part of the timed chain may not come from the disk."""
    size = preset.cold_bytes
    n = size // BLOCK_BYTES
    source = make_payload_bytes(size, rng)
    payloads = split(source, BLOCK_BYTES)
    timed_chain, region_chain = (make_tokens(n * BLOCK_TOKENS, rng) for _ in range(2))
    ident = bench_identity(BLOCK_TOKENS, BLOCK_BYTES)
    plain = root / "cold_load-plain.bin"
    store_bench.write_file(plain, payloads)
    dest = touched_buffer(size)
    dests = split(dest, BLOCK_BYTES)
    seconds: dict[str, list[float]] = {
        k: [] for k in ("warm_load", "warm_file", "cold_load", "cold_file")
    }
    resident: dict[str, list[float]] = {"data_file": [], "plain_file": []}
    method, why = "", None

    def read_plain() -> float:
        dest.fill(0)
        gc.collect()
        started = time.perf_counter()
        got = store_bench.read_file(plain, dests)
        took = time.perf_counter() - started
        if got != size or not same_bytes(dest, source):
            raise RuntimeError("the plain file read did not reproduce the payloads")
        return took

    daemon = _daemon(root, "cold_load", 2 * size)
    with daemon:
        _publish(daemon, ident, [timed_chain, region_chain], payloads)
        data_file = daemon.data_dir / "data.mdb"
        for cold in (False, True):
            for round_ in range(preset.repeat + (0 if cold else 1)):  # warm-cache: one warm-up
                _restart(daemon)
                region = size + REGION_SLACK_BYTES
                with Client(daemon.socket, region_bytes=region, timeout=600) as client:
                    _timed_load(client, ident, region_chain, n)
                    if cold:  # what the daemon has mapped (that chain, the records) stays
                        method, why = _evict([data_file, plain], preset.drop_caches)
                        resident["data_file"].append(resident_fraction(data_file))
                        resident["plain_file"].append(resident_fraction(plain))
                    steps: dict[str, Callable[[], float]] = {
                        "load": lambda: _timed_load(client, ident, timed_chain, n),
                        "file": read_plain,
                    }
                    for step in rotated(list(steps), round_):
                        took = steps[step]()
                        if cold or round_:
                            seconds[f"{'cold' if cold else 'warm'}_{step}"].append(took)
                    if not _region_holds(client, source):
                        raise RuntimeError("the cold load did not reproduce the payloads")
    rate = {name: round(gbps(size, median(s)), 3) for name, s in seconds.items()}
    # The fraction of each file in the page cache as each cold round began (mincore): the plain
    # file's should be 0, data.mdb's about half (the chain loaded first, still mapped).
    resident_rounds = {name: [round(v, 4) for v in values] for name, values in resident.items()}
    return row(
        "GB/s",
        {"page_cache_gbps": rate["warm_load"], "cold_gbps": rate["cold_load"]},
        {"page_cache_gbps": rate["warm_file"], "cold_gbps": rate["cold_file"]},
        {
            "page_cache": ratio_of(rate["warm_load"], rate["warm_file"]),
            "cold": ratio_of(rate["cold_load"], rate["cold_file"]),
        },
        [Target("ratio.page_cache", ">=", 0.8), Target("ratio.cold", ">=", 0.9)],
        cold_method=method,
        drop_caches_skipped=why,
        resident_before_cold=resident_rounds,
        settings={"bytes": size, "block_bytes": BLOCK_BYTES},
    )
