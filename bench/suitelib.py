"""What the sections of bench/run.py share: a daemon started for one section, its memory, latency
percentiles and the machine's description. Built on daemon_bench's Daemon and HelloPinger."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Self

import daemon_bench
import numpy as np

GiB = 1 << 30
MiB = 1 << 20


class SuiteDaemon(daemon_bench.Daemon):
    """`python -m prefixd serve` on `root/name/data` with extra flags (and `knobs`, NAME=VALUE
    settings serve does not list, through bench/tuned.py), its socket in a short temporary
    directory of its own. `start_s` is spawn -> READY=1 -> a `hello` answered on a
    fresh connection: what an engine waits for before its first request."""

    def __init__(
        self,
        root: Path,
        name: str,
        *,
        map_size: int = 8 * GiB,
        extra: Sequence[str] = (),
        knobs: Sequence[str] = (),
    ) -> None:
        base = root / name
        base.mkdir(parents=True)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="pxd-"))  # a socket path holds 107 bytes
        super().__init__(base / "data", self.sock_dir, SimpleNamespace(total_bytes=0, workers=None))
        self.map_size = map_size
        self.extra = list(extra)
        self.knobs = list(knobs)
        self.start_s = 0.0

    def command(self) -> list[str]:
        python, *serve = super().command() + self.extra
        if not self.knobs:
            return [python, *serve]
        assert serve[:3] == ["-m", "prefixd", "serve"], serve
        return [python, str(Path(__file__).with_name("tuned.py")), *self.knobs, "--", *serve[3:]]

    def start(self) -> None:
        started = time.perf_counter()
        super().start()
        hello = daemon_bench.HelloPinger(self.socket)
        try:
            hello()
        finally:
            hello.close()
        self.start_s = time.perf_counter() - started

    def restart(self, *, stopped: bool = False) -> None:
        """Stop (unless `stopped` already) and start again on the same store and socket."""
        if not stopped:
            self.stop()
        self.notify_path.unlink(missing_ok=True)  # the readiness socket of the last start
        self.start()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def memory(self) -> dict[str, int]:
        """VmRSS (and its anonymous and file-backed parts) of the daemon, in bytes."""
        return process_memory(self.pid)

    def close(self) -> None:
        try:
            code = self.stop()
        finally:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
        if code != 0:
            raise RuntimeError(f"the daemon exited with {code} after SIGTERM{self.tail()}")

    def __enter__(self) -> Self:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def process_memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon and RssFile of a process from /proc/<pid>/status, in bytes."""
    wanted = {"VmRSS": "rss", "RssAnon": "rss_anon", "RssFile": "rss_file"}
    found: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in wanted:
                found[wanted[key]] = int(value.split()[0]) * 1024  # kB
    return found


def percentiles_us(seconds: Sequence[float]) -> dict[str, float]:
    """p50 and p99 (and mean, n) in microseconds; zeros for no samples."""
    if not seconds:
        return {"n": 0, "p50": 0.0, "p99": 0.0, "mean": 0.0}
    us = np.asarray(seconds) * 1e6
    return {
        "n": len(seconds),
        "p50": round(float(np.percentile(us, 50)), 1),
        "p99": round(float(np.percentile(us, 99)), 1),
        "mean": round(float(us.mean()), 1),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def machine_info(loadavg_start: tuple[float, ...]) -> dict[str, Any]:
    """daemon_bench's machine description, with the CPU model and the usable cores."""
    info = daemon_bench.machine_info(loadavg_start)
    info["cpu_model"] = cpu_model()
    info["cores_usable"] = len(os.sched_getaffinity(0))
    return info


def ratio(a: float, b: float) -> float | None:
    """a / b rounded, or None where b is not positive (nothing was measured)."""
    return round(a / b, 3) if b > 0 else None


__all__ = [
    "GiB",
    "MiB",
    "SuiteDaemon",
    "cpu_model",
    "machine_info",
    "percentiles_us",
    "process_memory",
    "ratio",
]
