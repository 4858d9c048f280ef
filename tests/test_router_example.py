"""examples/router.py runs as a user runs it: local daemons with KV events, three policies."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_router_example_compares_its_policies() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "router.py"), "--nodes", "2", "--requests", "80"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    rates = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^(\w+)\s+token_hit_rate ([0-9.]+)", done.stdout, re.MULTILINE)
    }
    assert set(rates) == {"score", "affinity", "round_robin"}, done.stdout
    # the index is built from the events: routing by it finds more of the shared prefixes
    assert rates["affinity"] > rates["round_robin"], done.stdout
