"""A Mooncake master on loopback, run as a child process: for the benchmarks (cluster_bench.py),
the tests (tests/cluster/conftest.py imports it from here) and trying the shared tier on one
machine (`LocalMaster(binary, workdir).start()`).

It runs the `mooncake_master` binary that the wheel `mooncake-transfer-engine-non-cuda` ships, on
free 127.0.0.1 ports, with its built-in HTTP metadata server (no etcd), and waits until its admin
endpoint reports `service_ready`. Production masters are run by the operator, not by prefixd.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prefixd.cluster.mooncake import MooncakeSettings

READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
# A read grants a key a lease this long; plain (unforced) removes of it fail meanwhile. Set
# explicitly rather than left at the 10 s default (unread objects do not expire with it).
LEASE_TTL = "30s"


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _stopped(task: Path) -> bool:
    """Whether a thread (/proc/PID/task/TID) is stopped by a signal (or gone)."""
    try:
        stat = (task / "stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] in ("T", "t")


class LocalMaster:
    """One `mooncake_master` process on fixed loopback ports: start, stop, pause, restart."""

    def __init__(self, binary: Path, workdir: Path) -> None:
        self.binary = binary
        self.workdir = workdir
        self.rpc_port, self.metadata_port, self.admin_port = _free_ports(3)
        self.log_path = workdir / "master.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.generation = 0  # starts so far: a restarted master has forgotten every object

    @property
    def master(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://127.0.0.1:{self.metadata_port}/metadata"

    def settings(self, **overrides: Any) -> MooncakeSettings:
        values: dict[str, Any] = {
            "master": self.master,
            "metadata": self.metadata,
            "local_hostname": "127.0.0.1",
            "segment_bytes": 64 << 20,
            "buffer_bytes": 4 << 20,
            "timeout_s": 2.0,
            "cooldown_s": 0.5,
        }
        values.update(overrides)
        return MooncakeSettings(**values)

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.metadata_port}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.admin_port}",
            f"--default_kv_lease_ttl={LEASE_TTL}",
            "--enable_metric_reporting=false",
            "--logtostderr",
        ]

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        assert not self.running, "the master is already running"
        env = dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        self.paused = False
        self.generation += 1
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self.ready():
            if not self.running:
                raise RuntimeError(f"mooncake_master exited at start:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master not ready in {READY_TIMEOUT_S} s")
            time.sleep(0.05)

    def ready(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://127.0.0.1:{self.admin_port}/health", timeout=1) as r:
                return bool(json.load(r).get("service_ready"))
        except (OSError, ValueError):
            return False

    def stop(self) -> None:
        """Terminate the master (SIGTERM, then SIGKILL); its in-memory metadata is lost."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        if self.paused:
            process.send_signal(signal.SIGCONT)
            self.paused = False
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def restart(self) -> None:
        self.stop()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the master keeps its sockets open but answers nothing (a hung master). Returns
        once every thread of it has stopped: one still running could answer a call made after."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        tasks = Path(f"/proc/{self.process.pid}/task")
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while not all(_stopped(task) for task in tasks.iterdir()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Mooncake master did not stop within {STOP_TIMEOUT_S} s")
            time.sleep(0.005)
        self.paused = True

    def resume(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)
        self.paused = False

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "(no log)"


def master_binary() -> Path | None:
    """The packaged `mooncake_master`, or None when the package is not installed."""
    try:
        from mooncake import store
    except ImportError:
        return None
    binary = Path(store.__file__).resolve().parent / "mooncake_master"
    if not binary.is_file():
        return None
    if not os.access(binary, os.X_OK):
        binary.chmod(binary.stat().st_mode | 0o111)  # what the package's own launcher does
    return binary
