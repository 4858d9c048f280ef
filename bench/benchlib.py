"""Helpers the benchmark scripts share: buffers that are already touched, timing, samples."""

from __future__ import annotations

import gc
import mmap
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from prefixd import Identity

COMPARE_CHUNK_BYTES = 64 << 20


@dataclass
class Samples:
    """Seconds of every timed repetition, per measure."""

    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, seconds: float) -> None:
        self.seconds.setdefault(name, []).append(seconds)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])


def touched_buffer(size: int) -> np.ndarray:
    """A destination whose pages are already faulted in, so no measure pays for first touch.
    Page-aligned, as a region is: a large numpy array starts 16 bytes into a page, and on M1 a
    read from the page cache runs about 3x slower into an address 8-24 bytes past its source's
    place in a page, so a plain file read into one would understate the limit."""
    buffer = np.frombuffer(mmap.mmap(-1, max(size, 1)), dtype=np.uint8)[:size]
    buffer.fill(0xA5)
    return buffer


def split(buffer: np.ndarray, size: int) -> list[np.ndarray]:
    return [buffer[off : off + size] for off in range(0, buffer.size, size)]


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Compare in pieces: a whole-array comparison would allocate another `a.size` bytes."""
    step = COMPARE_CHUNK_BYTES
    return a.size == b.size and all(
        np.array_equal(a[off : off + step], b[off : off + step]) for off in range(0, a.size, step)
    )


def removed(path: Path) -> None:
    """Remove what an earlier measure wrote at `path` and let the file system settle the deletion
    (`sync`: on a file system mounted with `discard`, freeing a GiB issues discards that otherwise
    stall whichever measure writes next, seconds at a time), so no measure pays for another's."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    os.sync()


def timed(action: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def gbps(n_bytes: int, seconds: float) -> float:
    return n_bytes / seconds / 1e9


def run_in_workdir(
    settings: Any,
    run: Callable[..., dict[str, Any]],
    print_table: Callable[[dict[str, Any]], None],
    *,
    prefix: str,
    with_sockets: bool = True,
) -> int:
    """A benchmark's `main`: run it in a temporary directory (under `settings.root` when set),
    and a short one for Unix sockets (a socket path holds 107 bytes), print JSON or a table."""
    import json
    import shutil
    import tempfile
    from pathlib import Path

    if settings.root is not None:
        settings.root.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir=settings.root))
    sock_dir = Path(tempfile.mkdtemp(prefix="pxd-")) if with_sockets else None
    try:
        report = run(settings, workdir, sock_dir) if sock_dir else run(settings, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if sock_dir is not None:
            shutil.rmtree(sock_dir, ignore_errors=True)
    if settings.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


def bench_identity(block_tokens: int, payload_bytes: int, tenant: str = "bench") -> Identity:
    """The identity every benchmark stores under: a fixed model, the block's layout in kv_layout."""
    return Identity(
        model="bench-model",
        weights="sha256:" + "0" * 64,
        tokenizer="bench-tokenizer",
        template="v1",
        rope="rope-default",
        kv_layout=f"bf16/tp1/rank0/{payload_bytes}B",
        block_tokens=block_tokens,
        tenant=tenant,
    )
