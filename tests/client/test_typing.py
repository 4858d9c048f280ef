"""The operations are declared once and bound to both clients (prefixd.client.operations): mypy
still checks every call against the operation's own signature, on either client."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SNIPPET = """\
from prefixd.client import AsyncClient, Client, Loaded
from prefixd.schema.identity import Identity


def blocking(client: Client, identity: Identity) -> None:
    loaded: Loaded = client.load(identity, [1], length=3)
    client.load(identity, [1], lenght=3)
    client.hot(1 << 20, tenant="a", limit=2)
    client.hot(1 << 20, "a")
    count: str = client.unpin(identity, [[1]])


async def awaited(client: AsyncClient, identity: Identity) -> None:
    loaded: Loaded = await client.load(identity, [1], length=3)
    await client.load(identity, [1], lenght=3)
    await client.lookup(identity, [[1]], hashes=None, pinned=True)
    await client.load_into(identity, [1], [], slot=2)
    not_awaited: Loaded = client.load(identity, [1])
"""


def test_mypy_checks_every_operation_on_both_clients(tmp_path: Path) -> None:
    snippet = tmp_path / "snippet.py"
    snippet.write_text(SNIPPET)
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache")]
    command += ["--no-error-summary", "--hide-error-context", str(snippet)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        command, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    errors = {
        (int(line.split(":")[1]), line.rsplit("[", 1)[-1].rstrip("]"))
        for line in done.stdout.splitlines()
        if ": error: " in line
    }
    assert errors == {
        (7, "call-arg"),  # lenght
        (9, "call-arg"),  # tenant is keyword-only
        (10, "assignment"),  # unpin counts blocks
        (15, "call-arg"),  # lenght
        (16, "call-arg"),  # pinned
        (17, "call-arg"),  # slot
        (18, "assignment"),  # a coroutine, not its result
    }, done.stdout + done.stderr
