"""The examples run as a new user runs them, and do what they say."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_transformers_restart_example_restores_exactly() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    done = subprocess.run(
        [sys.executable, str(REPO / "examples" / "transformers_restart.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "max abs logit difference vs a full prefill:" in done.stdout, done.stdout
    assert "reusable tokens: 80 of 96" in done.stdout, done.stdout
