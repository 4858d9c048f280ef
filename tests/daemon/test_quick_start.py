"""The README's quick start, run as written on a node of the test's own: its shell block as root
from a copy of this checkout, then an engine's first round trip as the engine's user.

The node is this machine seen through a mount namespace: /etc, /opt, /usr and /var are overlays
whose changes land in the test's directory (useradd, the venv under /opt/prefixd, the units in
/etc/systemd/system, the store under /var/lib), /run is empty, and `systemctl` is
tests/daemon/systemctl_standin.py, which does what systemd does with the installed units. So the
block installs, creates the service user, starts the daemon as that user and checks it exactly as
an operator's shell would, and the machine keeps none of it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixd import Store

from ..readme import readme_block
from .conftest import REPO, daemon_env

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: users, namespaces and mounts"),
    pytest.mark.skipif(shutil.which("unshare") is None, reason="unshare (util-linux) is needed"),
]

INSTALL_TIMEOUT_S = 900.0  # pip fetches prefixd's dependencies into the fresh venv

DRIVER = r"""
set -eu
node="$1"
for dir in etc opt usr var; do
    mkdir -p "$node/$dir.up" "$node/$dir.work"
    mount -t overlay overlay \
        -o "lowerdir=/$dir,upperdir=$node/$dir.up,workdir=$node/$dir.work" "/$dir"
done
mount -t tmpfs tmpfs /run
# root's shell on a Debian node: the system's python3, not one under /root (which the service
# user could not run), and the stand-in for systemctl
export PATH="$node/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
useradd --system --user-group --no-create-home --shell /usr/sbin/nologin engine
trap 'systemctl stop prefixd.service' EXIT
cd "$node/src"
sh -eux "$node/quick-start.sh"
runuser -u engine -- /opt/prefixd/bin/python "$node/engine.py"
# the service user's own command, the daemon stopped and no systemd around it: the node's store
systemctl stop prefixd.service
runuser -u prefixd -- /opt/prefixd/bin/prefixd verify --json > "$node/verified.json"
"""

# The engine's first round trip, through the installed prefixd, with no flag or setting.
ENGINE = """
import numpy as np, prefixd, sys
from prefixd.client import Client
assert prefixd.__file__.startswith("/opt/prefixd/"), prefixd.__file__
identity = prefixd.Identity(model="m", weights="w", tokenizer="t", template="c", rope="r",
                            kv_layout="bf16", block_tokens=4, tenant="engine")
tokens = np.arange(8, dtype=np.uint32)
with Client("/run/prefixd/prefixd.sock", region_bytes=1 << 20) as client:
    client.put(identity, tokens, [b"a" * 64, b"b" * 64])
    with client.load(identity, tokens) as loaded:
        assert [bytes(v) for v in loaded.views] == [b"a" * 64, b"b" * 64]
print("engine round trip ok")
"""


def overlays_work(scratch: Path) -> bool:
    (scratch / "up").mkdir()
    (scratch / "work").mkdir()
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", "mount", "-t", "overlay",
         "overlay", "-o", f"lowerdir=/etc,upperdir={scratch}/up,workdir={scratch}/work", "/etc"],
        capture_output=True,
        check=False,
    )  # fmt: skip
    return probe.returncode == 0


def root_daemons_store(var_upper: Path) -> None:
    """/var/lib/prefixd on the node: a store root's `prefixd serve` made before the units were
    installed, which the unit's StateDirectory= hands to the service user, as systemd does.
    Whatever the machine has there (CI serves a default store beside the suite) stays hidden
    behind an opaque directory in the overlay's upper layer: the node never opens or copies it."""
    store = var_upper / "lib" / "prefixd"
    store.mkdir(parents=True)
    os.setxattr(store, "trusted.overlay.opaque", b"y")
    Store.open(store).close()


@pytest.fixture
def node() -> Iterator[Path]:
    """The node's directory: overlays' upper layers, a copy of the checkout, the stand-in."""
    root = Path(tempfile.mkdtemp(prefix="pfx-quick-", dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        if not overlays_work(root):
            pytest.skip("this kernel does not mount overlayfs in a mount namespace")
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            check=True,
        ).stdout.decode()
        for name in filter(None, listed.split("\0")):
            source = REPO / name
            if source.is_file():
                (root / "src" / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, root / "src" / name)
        root_daemons_store(root / "var.up")
        (root / "bin").mkdir()
        standin = root / "bin" / "systemctl"
        standin.write_text(
            f'#!/bin/sh\nexec {sys.executable} {REPO / "tests/daemon/systemctl_standin.py"} "$@"\n'
        )
        standin.chmod(0o755)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_quick_start_builds_a_node_an_engine_uses(node: Path) -> None:
    block = readme_block("## Quick start: a node", "sh")
    assert "ENGINE_USER" in block and "systemctl enable --now prefixd.socket" in block
    (node / "quick-start.sh").write_text(block.replace("ENGINE_USER", "engine"))
    (node / "engine.py").write_text(textwrap.dedent(ENGINE))
    (node / "driver.sh").write_text(DRIVER)
    machine_accounts = Path("/etc/passwd").read_bytes()
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--",
         "sh", str(node / "driver.sh"), str(node)],
        env=daemon_env(),
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
        check=False,
    )  # fmt: skip
    output = done.stdout + done.stderr[-6000:]
    assert done.returncode == 0, output
    assert "prefixd health" in done.stdout or '"status": "ok"' in done.stdout, output
    assert "engine round trip ok" in done.stdout, output
    verified = json.loads((node / "verified.json").read_text())
    # the engine's two blocks (and whatever the machine's /var/lib/prefixd held), no problem
    assert (verified["mode"], verified["path"], verified["count"]) == (
        "offline",
        "/var/lib/prefixd",
        0,
    ), verified
    assert verified["blocks"] >= 2, verified
    # the block made the accounts and the install on the node, none on the machine
    assert b"\nprefixd:" in (node / "etc.up" / "passwd").read_bytes()
    assert (node / "opt.up" / "prefixd" / "bin" / "prefixd").is_file()
    assert Path("/etc/passwd").read_bytes() == machine_accounts
