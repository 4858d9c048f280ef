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

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixd.cluster import close_abandoned
from prefixd.cluster.mooncake import MooncakeSettings

_BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, _BENCH)  # the master is bench/localmaster.py, shared with bench/cluster_bench.py
try:
    from localmaster import LocalMaster as MooncakeMaster
finally:
    sys.path.remove(_BENCH)


def request_bound_s(timeout_s: float) -> float:
    """The longest a daemon's request may take while the tier fails under `--cluster-timeout-s
    timeout_s`: it may meet one tier call that runs to the child process's bound
    (prefixd.cluster.child), plus slack for a busy machine."""
    return MooncakeSettings(timeout_s=timeout_s).longest_call_s + 1.0 + 3.0


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
