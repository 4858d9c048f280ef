"""Where one library load's time goes, phase by phase, beside the floors of its copy pass.

A store holds one chain of `--blocks` payloads of `--block-kib` (stored raw); it is loaded from
the page cache into one buffer again and again, and each load is timed phase by phase:

* walk:        finding the stored prefix (Reader._walk);
* gather:      reading each block's record and the places of its chunks (Reader._gather);
* read_ahead:  the read-ahead call over the chunks (codec._read_ahead);
* copy_verify: preadv into the buffer and crc32c, on the store's copy pool (the rest of
               PayloadCodec.decode_verified);
* total:       Store.load as the caller sees it.

The phases are timed by wrapping those methods for the run: timers around the calls, nothing
else changes. In the same run, on a plain file of the same bytes in the page cache: preadv +
crc32c in 1 MiB pieces on one thread and on two (half the bytes each), and a one-thread memcpy
of the same bytes between two touched buffers (the copy pass's floors). Each kind runs back to
back, as the loads do (the bytes partly stay in the CPU's last-level cache from one run to the
next, for all of them alike). Medians; GB/s means 1e9 bytes per second.

    python bench/load_phases.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
from benchlib import bench_identity, split
from daemon_bench import make_payload_bytes
from limitlib import MAP_SIZE

from prefixd import Store
from prefixd.store import codec, read

PIECE_BYTES = 1 << 20
BLOCK_TOKENS = 256
PHASES = ("walk", "gather", "read_ahead", "decode", "total")


@contextmanager
def timed(spent: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in each wrapped method to `spent` while inside."""
    targets: list[tuple[Any, str, str]] = [
        (read.Reader, "_walk", "walk"),
        (read.Reader, "_gather", "gather"),
        (codec, "_read_ahead", "read_ahead"),
        (codec.PayloadCodec, "decode_verified", "decode"),
        (read.Reader, "load", "total"),
    ]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]

    def wrapper(inner: Callable[..., Any], phase: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - started

        return run

    for (owner, name, phase), (_, _, inner) in zip(targets, originals):
        setattr(owner, name, wrapper(inner, phase))
    try:
        yield
    finally:
        for owner, name, inner in originals:
            setattr(owner, name, inner)


def load_phases(workdir: Path, blocks: int, block_bytes: int, loads: int) -> dict[str, float]:
    """Median milliseconds of each phase over `loads` loads (after as many untimed ones)."""
    rng = np.random.default_rng(7)
    ident = bench_identity(BLOCK_TOKENS, block_bytes)
    tokens = rng.integers(0, 128_000, blocks * BLOCK_TOKENS, dtype=np.uint32)
    payloads = split(make_payload_bytes(blocks * block_bytes, rng), block_bytes)
    out = np.zeros(blocks * block_bytes, dtype=np.uint8)
    per_load: dict[str, list[float]] = {phase: [] for phase in PHASES}
    with Store.open(workdir / "store", map_size=MAP_SIZE) as store:
        store.put(ident, tokens, payloads)
        for round_ in range(2 * loads):
            spent: dict[str, float] = {}
            with timed(spent):
                result = store.load(ident, tokens, out)
            if result.n_blocks != blocks:
                raise RuntimeError(f"loaded {result.n_blocks} of {blocks} blocks")
            if round_ >= loads:
                for phase in PHASES:
                    per_load[phase].append(spent.get(phase, 0.0))
    ms = {phase: statistics.median(values) * 1e3 for phase, values in per_load.items()}
    ms["copy_verify"] = ms.pop("decode") - ms["read_ahead"]
    return {phase: round(value, 3) for phase, value in ms.items()}


def _preadv_crc(fd: int, view: memoryview, offsets: Sequence[int]) -> None:
    for offset in offsets:
        piece = view[offset : offset + PIECE_BYTES]
        os.preadv(fd, [piece], offset)
        crc32c.crc32c(piece)


def floors(workdir: Path, size: int, repeat: int) -> dict[str, float]:
    """GB/s of the copy pass's floors on a plain file of `size` bytes in the page cache."""
    path = workdir / "plain.bin"
    source = make_payload_bytes(size, np.random.default_rng(8))
    path.write_bytes(source)
    dest = np.ones(size, dtype=np.uint8)  # touched: no page faults in the timing
    view = memoryview(dest).cast("B")
    offsets = list(range(0, size, PIECE_BYTES))
    halves = [offsets[: len(offsets) // 2], offsets[len(offsets) // 2 :]]
    fd = os.open(path, os.O_RDONLY)
    src = np.frombuffer(source, dtype=np.uint8)
    try:
        with ThreadPoolExecutor(2) as pool:
            kinds: dict[str, Callable[[], object]] = {
                "preadv_crc_1_thread": lambda: _preadv_crc(fd, view, offsets),
                "preadv_crc_2_threads": lambda: list(
                    pool.map(lambda part: _preadv_crc(fd, view, part), halves)
                ),
                "memcpy_1_thread": lambda: np.copyto(dest, src),
            }
            seconds: dict[str, list[float]] = {name: [] for name in kinds}
            for name, run in kinds.items():  # back to back, as the loads are timed
                for round_ in range(1 + repeat):
                    started = time.perf_counter()
                    run()
                    if round_:
                        seconds[name].append(time.perf_counter() - started)
    finally:
        os.close(fd)
    return {name: round(size / statistics.median(s) / 1e9, 2) for name, s in seconds.items()}


def measure(blocks: int, block_kib: int, loads: int) -> dict[str, Any]:
    block_bytes = block_kib << 10
    size = blocks * block_bytes
    with tempfile.TemporaryDirectory(prefix="prefixd-load-phases-") as tmp:
        phases = load_phases(Path(tmp), blocks, block_bytes, loads)
        floor = floors(Path(tmp), size, loads)
    return {
        "phases_ms": phases,
        "load_gbps": round(size / (phases["total"] / 1e3) / 1e9, 2),
        "floors_gbps": floor,
        "settings": {"blocks": blocks, "block_bytes": block_bytes, "loads": loads},
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--loads", type=int, default=200, help="timed loads (as many warm up)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    report = measure(args.blocks, args.block_kib, args.loads)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
