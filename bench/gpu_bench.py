"""The last hop: stored prefixes into engine tensors (`Client.load_into`) and back (`store_from`).

One run on one machine, against one `python -m prefixd serve` started for it (temporary data
directory and socket, as bench/daemon_bench.py does). A prefix of `--size-mib` in `--block-mib`
blocks is stored first; then, in the same run:

On the CPU (always):

* load_into:  `Client.load_into(identity, tokens, destinations, slots=--slots)` of the whole prefix
              into preallocated CPU tensors (one block each: views of one uint8 tensor), through a
              region of `--slots` staging slots of `--slot-mib` each. Every batch goes through the
              daemon's verified `load` (checksums checked) before it is copied out of the region.
* e2e:        what an engine does on a hit: `Client.lookup`, then `load_into` of what it found.
* memcpy:     `numpy.copyto` of the same bytes into the same destination, in one call (the copy
              daemon_bench and store_bench compare with): `load_into_vs_memcpy`.
* store_from: `Client.store_from` of the prefix from CPU tensors, in runs of `--run-blocks` blocks
              (one future each, all submitted, then waited for), into a prefix purged just before.
* put:        the baseline for store_from: the daemon's put path, `Client.put` of the same runs from
              numpy arrays (staged into the client's region), also into a purged prefix:
              `store_from_vs_put`. Both are the same daemon work; store_from adds a thread and a
              copy from tensors, put a copy from arrays.

Without CUDA the copies out of the region are synchronous: a CPU load_into is the daemon's verified
copy into the region and then a second copy out of it, one after the other, so it stays well under
one memcpy. The CPU figures show that the pipeline works and what it costs; the CUDA ones whether
the daemon keeps the copy engine busy.

On CUDA (`torch.cuda.is_available()`), in addition:

* load_into:  the same pipeline into CUDA tensors: the client's region is pinned (cudaHostRegister,
              before timing), the copies run with non_blocking=True on prefixd's copy stream while
              the daemon verifies the next slot; timed until the copies finished.
* pinned_h2d: a plain torch copy of the same bytes from a pinned host tensor
              (`torch.empty(n, dtype=uint8, pin_memory=True)`), `.to("cuda", non_blocking=True)`
              and a synchronize: the ceiling, `load_into_vs_pinned_h2d` (target >= 0.85).
* e2e:        lookup + load_into + synchronize of the whole prefix, seconds and GB/s.
* store_from: from CUDA tensors (device-to-host copies into the publisher's pinned region, then
              the put), into a purged prefix.

Honesty: destinations are allocated and written before any timing and zeroed before every timed
repetition; after every repetition (outside the timing) they are compared with the stored bytes,
and every store is checked to have stored every block (and its bytes are loaded back and
compared). Every throughput is the median of `--repeat` timed repetitions after one untimed
warm-up round; within a round the measures are interleaved, their order rotating. GB/s means 1e9
bytes per second. The payloads are bf16 normals, like a KV cache, uncompressed.

    python bench/gpu_bench.py --json
    python bench/gpu_bench.py --quick
    python bench/gpu_bench.py --size-mib 4096 --slots 2 --slot-mib 64
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from benchlib import Samples, bench_identity, gbps, run_in_workdir, split, timed
from daemon_bench import Daemon, make_payload_bytes, make_tokens

from prefixd import Identity
from prefixd.client import Client

MiB = 1 << 20
BLOCK_TOKENS = 256
SEED = 20240607
TARGET_LOAD_INTO_VS_PINNED_H2D = 0.85
LOAD_TENANT = "bench-load"
STORE_TENANT = "bench-store"  # purged before every timed store
FULL = {"size_mib": 1024, "slot_mib": 16, "run_blocks": 64, "repeat": 5}
QUICK = {"size_mib": 32, "slot_mib": 4, "run_blocks": 8, "repeat": 2}


@dataclass(frozen=True)
class Settings:
    total_bytes: int
    block_bytes: int
    n_blocks: int
    slots: int
    slot_bytes: int
    run_blocks: int
    repeat: int
    quick: bool
    cuda: bool
    root: Path | None
    json: bool
    verbose: bool
    workers: int | None = None  # for daemon_bench.Daemon: the daemon's own default


def parse_args(argv: Sequence[str] | None = None) -> Settings:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="a small run of a few seconds")
    parser.add_argument("--size-mib", type=int, help="prefix size (default 1024, quick 32)")
    parser.add_argument("--block-mib", type=int, default=1, help="payload per block")
    parser.add_argument("--slots", type=int, default=3, help="staging slots of load_into")
    parser.add_argument("--slot-mib", type=int, help="bytes per slot (default 16, quick 4)")
    parser.add_argument("--run-blocks", type=int, help="blocks per store (default 64, quick 8)")
    parser.add_argument("--repeat", type=int, help="timed repetitions (default 5, quick 2)")
    parser.add_argument("--no-cuda", action="store_true", help="skip the CUDA measures")
    parser.add_argument("--dir", type=Path, help="where to make the temporary data directory")
    parser.add_argument("-v", "--verbose", action="store_true", help="progress on stderr")
    args = parser.parse_args(argv)
    defaults = QUICK if args.quick else FULL
    given = {k: getattr(args, k) for k in defaults if getattr(args, k) is not None}
    size_mib, slot_mib, run_blocks, repeat = ({**defaults, **given}[k] for k in defaults)
    if min(size_mib, args.block_mib, args.slots, slot_mib, run_blocks, repeat) <= 0:
        parser.error("sizes, --slots, --run-blocks and --repeat must be positive")
    if size_mib % args.block_mib:
        parser.error("--size-mib must be a multiple of --block-mib")
    if slot_mib < args.block_mib:
        parser.error("a slot must hold a block: --slot-mib >= --block-mib")
    return Settings(
        total_bytes=size_mib * MiB,
        block_bytes=args.block_mib * MiB,
        n_blocks=size_mib // args.block_mib,
        slots=args.slots,
        slot_bytes=slot_mib * MiB,
        run_blocks=min(run_blocks, size_mib // args.block_mib),
        repeat=repeat,
        quick=args.quick,
        cuda=torch.cuda.is_available() and not args.no_cuda,
        root=args.dir,
        json=args.json,
        verbose=args.verbose,
    )


def log(settings: Settings, message: str) -> None:
    if settings.verbose:
        print(message, file=sys.stderr, flush=True)


# --- the measures ------------------------------------------------------------------------------


class Bench:
    """Everything the measures share: the daemon's clients, the prefix, the destinations."""

    def __init__(self, settings: Settings, load: Client, store: Client, source: np.ndarray):
        self.s = settings
        self.load_client = load  # its region: the staging slots of load_into
        self.store_client = store  # its region and its publisher's: one run of blocks each
        self.source = source  # the stored bytes, block after block
        self.source_t = torch.from_numpy(source)
        self.tokens = make_tokens(settings.n_blocks * BLOCK_TOKENS, np.random.default_rng(SEED))
        self.load_ident = bench_identity(BLOCK_TOKENS, settings.block_bytes, LOAD_TENANT)
        self.store_ident = bench_identity(BLOCK_TOKENS, settings.block_bytes, STORE_TENANT)
        self.payloads = split(source, settings.block_bytes)
        self.samples = Samples()
        # The CPU destination, written once now so no measure pays for first touch.
        self.dest = torch.full((settings.total_bytes,), 0xA5, dtype=torch.uint8)
        self.dest_blocks = list(self.dest.split(settings.block_bytes))

    # -- helpers

    def put_runs(self, ident: Identity) -> int:
        """The prefix through `Client.put`, `run_blocks` blocks per request; blocks stored."""
        stored, run, bt = 0, self.s.run_blocks, BLOCK_TOKENS
        for first in range(0, self.s.n_blocks, run):
            end = min(first + run, self.s.n_blocks)
            result = self.store_client.put(
                ident, self.tokens[: end * bt], self.payloads[first:end], first_block=first
            )
            stored += result.stored
        return stored

    def store_from_runs(self, sources: list[torch.Tensor]) -> int:
        """The prefix through `Client.store_from` (all runs submitted, then waited for)."""
        run, bt = self.s.run_blocks, BLOCK_TOKENS
        futures = [
            self.store_client.store_from(
                self.store_ident,
                self.tokens[: min(first + run, self.s.n_blocks) * bt],
                sources[first : first + run],
                first_block=first,
                region_bytes=run * self.s.block_bytes,
            )
            for first in range(0, self.s.n_blocks, run)
        ]
        return sum(future.result().stored for future in futures)

    def purge_store_prefix(self) -> None:
        self.store_client.purge(tenant=STORE_TENANT)
        [hit] = self.store_client.lookup(self.store_ident, [self.tokens])
        if hit.n_blocks:
            raise RuntimeError(f"the purge left {hit.n_blocks} blocks of the store prefix")

    def check_installed(self, installed: Any, what: str) -> None:
        n = self.s.n_blocks
        if (
            installed.n_blocks != n
            or not installed.complete
            or installed.n_bytes != self.s.total_bytes
        ):
            raise RuntimeError(f"{what} installed {installed.n_blocks} of {n} blocks")

    def check_cpu_dest(self, what: str) -> None:
        if not torch.equal(self.dest, self.source_t):
            raise RuntimeError(f"{what}: the destinations do not hold the stored bytes")

    def check_stored(self, stored: int, what: str) -> None:
        """Every block was stored anew, and loads back as the bytes that were stored."""
        if stored != self.s.n_blocks:
            raise RuntimeError(f"{what} stored {stored} of {self.s.n_blocks} blocks")
        self.dest.zero_()
        installed = self.load_client.load_into(
            self.store_ident, self.tokens, self.dest_blocks, slots=self.s.slots
        )
        self.check_installed(installed, f"loading back {what}")
        self.check_cpu_dest(f"loading back {what}")

    def rounds(
        self,
        actions: dict[str, Callable[[], Any]],
        before: dict[str, Callable[[], None]],
        after: dict[str, Callable[[Any], None]],
    ) -> None:
        """One untimed warm-up round and `repeat` timed ones; the order rotates every round."""
        names = list(actions)
        for round_ in range(self.s.repeat + 1):
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                before[name]()
                seconds, result = timed(actions[name])
                after[name](result)
                if round_:
                    self.samples.add(name, seconds)
            if round_:
                done = "  ".join(f"{n} {self.samples.seconds[n][-1]:.3f}s" for n in names)
                log(self.s, f"round {round_}: {done}")

    # -- CPU

    def bench_cpu(self) -> None:
        dest_np = self.dest.numpy()
        slots = self.s.slots

        def load_into() -> Any:
            return self.load_client.load_into(
                self.load_ident, self.tokens, self.dest_blocks, slots=slots
            )

        def e2e() -> Any:
            [hit] = self.load_client.lookup(self.load_ident, [self.tokens])
            dests = self.dest_blocks[: hit.n_blocks]
            return self.load_client.load_into(self.load_ident, self.tokens, dests, slots=slots)

        def loaded(what: str) -> Callable[[Any], None]:
            def check(installed: Any) -> None:
                self.check_installed(installed, what)
                self.check_cpu_dest(what)

            return check

        cpu_sources = list(self.source_t.split(self.s.block_bytes))
        zero = self.dest.zero_
        self.rounds(
            actions={
                "cpu_load_into": load_into,
                "cpu_e2e": e2e,
                "memcpy": lambda: np.copyto(dest_np, self.source),
                "cpu_store_from": lambda: self.store_from_runs(cpu_sources),
                "put": lambda: self.put_runs(self.store_ident),
            },
            before={
                "cpu_load_into": zero,
                "cpu_e2e": zero,
                "memcpy": zero,
                "cpu_store_from": self.purge_store_prefix,
                "put": self.purge_store_prefix,
            },
            after={
                "cpu_load_into": loaded("load_into"),
                "cpu_e2e": loaded("lookup + load_into"),
                "memcpy": lambda _: self.check_cpu_dest("memcpy"),
                "cpu_store_from": lambda n: self.check_stored(n, "store_from (CPU)"),
                "put": lambda n: self.check_stored(n, "put"),
            },
        )

    # -- CUDA

    def bench_cuda(self) -> None:
        device = torch.device("cuda")
        slots = self.s.slots
        region = self.load_client.region
        assert region is not None
        if not region.pin():
            raise RuntimeError("the client's region could not be pinned (cudaHostRegister)")
        expected = self.source_t.to(device)  # the stored bytes on the GPU, to compare with
        dest = torch.full_like(expected, 0xA5)  # allocated and written before any timing
        dest_blocks = list(dest.split(self.s.block_bytes))
        gpu_sources = list(expected.split(self.s.block_bytes))
        pinned = torch.empty(self.s.total_bytes, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(self.source_t)
        torch.cuda.synchronize()

        def load_into() -> Any:
            installed = self.load_client.load_into(
                self.load_ident, self.tokens, dest_blocks, slots=slots, wait=True
            )
            torch.cuda.synchronize()
            return installed

        def e2e() -> Any:
            [hit] = self.load_client.lookup(self.load_ident, [self.tokens])
            dests = dest_blocks[: hit.n_blocks]
            installed = self.load_client.load_into(
                self.load_ident, self.tokens, dests, slots=slots, wait=False
            )
            torch.cuda.synchronize()
            return installed

        def pinned_h2d() -> torch.Tensor:
            out = pinned.to(device, non_blocking=True)
            torch.cuda.synchronize()
            return out

        def zero() -> None:
            dest.zero_()
            torch.cuda.synchronize()

        def loaded(what: str) -> Callable[[Any], None]:
            def check(installed: Any) -> None:
                self.check_installed(installed, what)
                if not torch.equal(dest, expected):
                    raise RuntimeError(f"{what}: the CUDA destinations do not hold the bytes")

            return check

        def copied(out: torch.Tensor) -> None:
            if not torch.equal(out, expected):
                raise RuntimeError("pinned_h2d: the copy does not hold the bytes")

        self.rounds(
            actions={
                "cuda_load_into": load_into,
                "cuda_e2e": e2e,
                "pinned_h2d": pinned_h2d,
                "cuda_store_from": lambda: self.store_from_runs(gpu_sources),
            },
            before={
                "cuda_load_into": zero,
                "cuda_e2e": zero,
                "pinned_h2d": lambda: None,
                "cuda_store_from": self.purge_store_prefix,
            },
            after={
                "cuda_load_into": loaded("load_into (CUDA)"),
                "cuda_e2e": loaded("lookup + load_into (CUDA)"),
                "pinned_h2d": copied,
                "cuda_store_from": lambda n: self.check_stored(n, "store_from (CUDA)"),
            },
        )


# --- report ------------------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(cuda: bool, loadavg_start: tuple[float, ...]) -> dict[str, Any]:
    return {
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
        "loadavg_start": [round(x, 2) for x in loadavg_start],
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }


def build_report(
    settings: Settings, samples: Samples, daemon: Daemon, loadavg_start: tuple[float, ...]
) -> dict[str, Any]:
    total = settings.total_bytes
    rate = {name: round(gbps(total, samples.median(name)), 3) for name in samples.seconds}

    def ratio(a: str, b: str) -> float:
        return round(rate[a] / rate[b], 3)

    cpu = {
        "load_into_gbps": rate["cpu_load_into"],
        "memcpy_gbps": rate["memcpy"],
        "e2e_seconds": round(samples.median("cpu_e2e"), 4),
        "e2e_gbps": rate["cpu_e2e"],
        "store_from_gbps": rate["cpu_store_from"],
        "put_gbps": rate["put"],
    }
    ratios = {
        "load_into_vs_memcpy": ratio("cpu_load_into", "memcpy"),
        "store_from_vs_put": ratio("cpu_store_from", "put"),
    }
    cuda: dict[str, Any] | None = None
    targets: dict[str, Any] = {}
    if settings.cuda:
        cuda = {
            "load_into_gbps": rate["cuda_load_into"],
            "pinned_h2d_gbps": rate["pinned_h2d"],
            "e2e_seconds": round(samples.median("cuda_e2e"), 4),
            "e2e_gbps": rate["cuda_e2e"],
            "store_from_gbps": rate["cuda_store_from"],
        }
        ratios["load_into_vs_pinned_h2d"] = ratio("cuda_load_into", "pinned_h2d")
        ratios["cuda_store_from_vs_put"] = ratio("cuda_store_from", "put")
        met = ratios["load_into_vs_pinned_h2d"] >= TARGET_LOAD_INTO_VS_PINNED_H2D
        targets = {
            "load_into_vs_pinned_h2d": TARGET_LOAD_INTO_VS_PINNED_H2D,
            "meets_load_into_vs_pinned_h2d": met,
        }
    return {
        "cpu": cpu,
        "cuda": cuda,
        "ratios": ratios,
        "targets": targets,
        "verified": True,  # every repetition was checked byte for byte (see the docstring)
        "settings": {
            "size_mib": total // MiB,
            "block_mib": settings.block_bytes // MiB,
            "n_blocks": settings.n_blocks,
            "block_tokens": BLOCK_TOKENS,
            "slots": settings.slots,
            "slot_mib": settings.slot_bytes // MiB,
            "region_bytes": settings.slots * settings.slot_bytes,
            "run_blocks": settings.run_blocks,
            "repeat": settings.repeat,
            "quick": settings.quick,
            "cuda": settings.cuda,
            "memcpy": "numpy.copyto of the whole prefix into the load_into destination",
            "store_baseline": "Client.put (the daemon put path) of the same runs of blocks",
            "compression": "none",
        },
        "seconds": {k: [round(s, 4) for s in v] for k, v in samples.seconds.items()},
        "daemon": {
            "startup_s": round(daemon.startup_s, 3),
            "exit_code": daemon.exit_code,
            "map_size": daemon.map_size,
        },
        "machine": machine_info(settings.cuda, loadavg_start),
    }


def print_table(report: dict[str, Any]) -> None:
    s, m = report["settings"], report["machine"]
    print(
        f"prefixd gpu bench: {s['size_mib']} MiB in {s['n_blocks']} x {s['block_mib']} MiB "
        f"blocks, {s['slots']} slots of {s['slot_mib']} MiB, median of {s['repeat']}"
    )
    print(
        f"  {m['cpu_model']}, {m['cpu_count']} cores, torch {m['torch']}, "
        f"CUDA device: {m['cuda_device'] or 'none'}"
    )
    rows = [
        ("CPU load_into (verified)", report["cpu"]["load_into_gbps"]),
        ("CPU lookup + load_into", report["cpu"]["e2e_gbps"]),
        ("memcpy", report["cpu"]["memcpy_gbps"]),
        ("CPU store_from", report["cpu"]["store_from_gbps"]),
        ("put (daemon put path)", report["cpu"]["put_gbps"]),
    ]
    if report["cuda"] is not None:
        rows += [
            ("CUDA load_into (verified)", report["cuda"]["load_into_gbps"]),
            ("CUDA lookup + load_into", report["cuda"]["e2e_gbps"]),
            ("pinned host -> GPU copy", report["cuda"]["pinned_h2d_gbps"]),
            ("CUDA store_from", report["cuda"]["store_from_gbps"]),
        ]
    for name, value in rows:
        print(f"  {name:<28}{value:>8.2f} GB/s")
    for name, value in report["ratios"].items():
        print(f"  {name:<28}{value:>8.2f}")
    if report["cuda"] is not None:
        target = report["targets"]
        verdict = "met" if target["meets_load_into_vs_pinned_h2d"] else "MISSED"
        print(f"  load_into_vs_pinned_h2d target {target['load_into_vs_pinned_h2d']}: {verdict}")
        print(f"  prefix into the GPU end to end: {report['cuda']['e2e_seconds']:.3f} s")


# --- main --------------------------------------------------------------------------------------


def run(settings: Settings, workdir: Path, sock_dir: Path) -> dict[str, Any]:
    loadavg_start = os.getloadavg()
    log(settings, f"generating {settings.total_bytes // MiB} MiB of bf16 payloads")
    source = make_payload_bytes(settings.total_bytes, np.random.default_rng(SEED))
    daemon = Daemon(workdir / "data", sock_dir, settings)  # type: ignore[arg-type]
    try:
        daemon.start()
        log(settings, f"daemon ready in {daemon.startup_s:.2f}s")
        region = settings.slots * settings.slot_bytes
        run_bytes = settings.run_blocks * settings.block_bytes
        with (
            Client(daemon.socket, region_bytes=region, timeout=300.0, name="bench-load") as load,
            Client(daemon.socket, region_bytes=run_bytes, timeout=300.0, name="bench-store") as st,
        ):
            bench = Bench(settings, load, st, source)
            seconds, stored = timed(lambda: bench.put_runs(bench.load_ident))
            if stored != settings.n_blocks:
                raise RuntimeError(f"put stored {stored} of {settings.n_blocks} blocks")
            log(settings, f"stored the prefix in {seconds:.2f}s")
            bench.bench_cpu()
            if settings.cuda:
                bench.bench_cuda()
            samples = bench.samples
    finally:
        code = daemon.stop()
    if code != 0:
        raise RuntimeError(f"the daemon exited with {code} after SIGTERM{daemon.tail()}")
    return build_report(settings, samples, daemon, loadavg_start)


def main(argv: Sequence[str] | None = None) -> int:
    return run_in_workdir(
        parse_args(argv), run, print_table, prefix="prefixd-gpu-bench-", with_sockets=True
    )


if __name__ == "__main__":
    raise SystemExit(main())
