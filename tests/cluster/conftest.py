"""A real Mooncake master on loopback for the shared-tier tests, and a handle to stop it.

`mooncake_master` (module scope) starts the `mooncake_master` binary that the PyPI wheel
`mooncake-transfer-engine-non-cuda` ships, on free 127.0.0.1 ports, with its built-in HTTP
metadata server (no etcd), in a temporary directory, and waits until its admin endpoint says
`service_ready`. It skips, with the reason, when the package cannot be imported (not installed, or
Debian's libibverbs1 missing: the wheel's binaries link libibverbs.so.1 even for TCP) or when the
binary does not run. `master_control` (function scope) hands the same master to a test that stops,
hangs (SIGSTOP) or restarts it, and restarts it afterwards if the test left it down.

Nothing here is autouse: other tests of this directory do not need Mooncake.
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from prefixd.cluster import MooncakeSettings, close_abandoned

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


class MooncakeMaster:
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
        """SIGSTOP: the master keeps its sockets open but answers nothing (a hung master)."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
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


def _master_binary() -> Path:
    # What pytest.importorskip does, for ImportError too: a missing libibverbs.so.1 raises a
    # plain ImportError, which importorskip (pytest >= 9, without exc_type) does not catch.
    try:
        from mooncake import store
    except ImportError as e:
        pytest.skip(
            f"Mooncake's client cannot be imported ({e}): pip install "
            "'mooncake-transfer-engine-non-cuda==0.3.13.post1' and apt-get install libibverbs1"
        )
    binary = Path(store.__file__).resolve().parent / "mooncake_master"
    if not binary.is_file():
        pytest.skip(f"the mooncake package has no mooncake_master binary ({binary})")
    if not os.access(binary, os.X_OK):
        binary.chmod(binary.stat().st_mode | 0o111)  # what the package's own launcher does
    try:
        done = subprocess.run(
            [str(binary), "--version"], check=False, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"mooncake_master does not run: {e}")
    if done.returncode != 0:
        pytest.skip(
            f"mooncake_master does not run (exit {done.returncode}; libibverbs1 missing?): "
            f"{(done.stderr or done.stdout).strip()[-500:]}"
        )
    return binary


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeMaster]:
    """A running master (module scope); tests share it, so each uses keys of its own."""
    master = MooncakeMaster(_master_binary(), tmp_path_factory.mktemp("mooncake"))
    master.start()
    try:
        yield master
    finally:
        if master.paused:
            master.resume()
        if master.running:
            close_abandoned()  # else Mooncake closes them at exit, seconds each with no master
        master.stop()


@pytest.fixture
def master_control(mooncake_master: MooncakeMaster) -> Iterator[MooncakeMaster]:
    """The master, for a test that stops, pauses or restarts it; running again afterwards."""
    yield mooncake_master
    if mooncake_master.paused:
        mooncake_master.resume()
    if not mooncake_master.running:
        mooncake_master.start()
