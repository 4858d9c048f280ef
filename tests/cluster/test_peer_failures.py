"""A peer daemon killed (SIGKILL, its tier process with it) while another fetches the blocks it
published: the tier's objects in the dead peer's segment become unreachable mid-transfer, and the
survivor answers every request within the tier's bound, serves only the bytes that were stored,
and keeps serving from its own store."""

from __future__ import annotations

import random
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixd.client import Client
from tests.waiting import wait_for

from ..daemon.conftest import Daemon, _factory, make_identity, payload
from .conftest import MooncakeMaster, request_bound_s

IDENTITY = make_identity(tenant="acme", block_tokens=16)
SIZE = 256 << 10
BLOCKS = 8
PROMPTS = 12
TIMEOUT_S = 1.0
BOUND_S = request_bound_s(TIMEOUT_S)


def tokens(seed: int) -> np.ndarray:
    return (np.arange(16 * BLOCKS, dtype=np.uint32) + 500_000_000 + seed * 10_000).astype(np.uint32)


def blocks(seed: int) -> list[bytes]:
    return [payload(seed, i, SIZE) for i in range(BLOCKS)]


@pytest.fixture
def nodes(tmp_path: Path, mooncake_master: MooncakeMaster) -> Iterator[tuple[Daemon, Daemon]]:
    flags = (
        "--cluster-master", mooncake_master.master,
        "--cluster-metadata", mooncake_master.metadata,
        "--cluster-segment-bytes", "64MiB",
        "--cluster-timeout-s", str(TIMEOUT_S),
        "--prefill-tokens-per-s", "100",  # every fetch is worth it
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pdp") as sockdir:  # noqa: SIM117
        with _factory(tmp_path, Path(sockdir)) as start:
            yield start(*flags, name="a"), start(*flags, name="b")


def test_a_peer_killed_mid_transfer(nodes: tuple[Daemon, Daemon]) -> None:
    a, b = nodes
    with Client(a.socket, region_bytes=4 << 20) as client:
        for seed in range(PROMPTS):
            assert client.put(IDENTITY, tokens(seed), blocks(seed)).stored == BLOCKS
        wait_for(
            lambda: (
                client.stats()["metrics"]["cluster"].get("published_blocks", 0) >= PROMPTS * BLOCKS
            ),
            "A's blocks published",
        )
    rng = random.Random(20261202)
    stop = threading.Event()
    fetching = threading.Event()  # B has fetched from the tier at least once
    latencies: list[float] = []
    failures: list[str] = []
    remote_hits = 0
    wanted = [1 << 62]  # answers B must have given before the test stops it
    enough = threading.Event()

    def node_b() -> None:
        nonlocal remote_hits
        with Client(b.socket, region_bytes=4 << 20) as client:
            while not stop.is_set():
                seed = rng.randrange(PROMPTS)
                started = time.monotonic()
                loaded = client.load(IDENTITY, tokens(seed))  # read through: none is local
                latencies.append(time.monotonic() - started)
                if [bytes(v) for v in loaded.views] != blocks(seed)[: loaded.n_blocks]:
                    failures.append(f"B served other bytes for {seed}")
                remote_hits += loaded.n_blocks
                loaded.release()
                if remote_hits:
                    fetching.set()
                started = time.monotonic()
                client.delete(IDENTITY, [tokens(seed)[:16]])  # the next load fetches again
                latencies.append(time.monotonic() - started)
                if len(latencies) >= wanted[0]:
                    enough.set()

    worker = threading.Thread(target=node_b)
    worker.start()
    try:
        assert fetching.wait(60), "B never fetched from the tier"
        stop.wait(rng.uniform(0.05, 0.3))  # mid-fetch, wherever it falls
        killed_at = len(latencies)
        wanted[0] = killed_at + 8  # four loads and deletes at least after the kill
        killed = time.monotonic()
        a.stop(signal.SIGKILL)  # A's tier process dies with it (PR_SET_PDEATHSIG)
        # B keeps asking while the master still lists A's segment
        assert enough.wait(10 * BOUND_S), "B answered too little after the kill"
        stop.wait(max(0.0, killed + 2.0 - time.monotonic()))
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not worker.is_alive(), "B's client never got its answer"
    assert not failures, failures
    worst = max(latencies)
    print(f"{len(latencies)} requests ({killed_at} before the kill), worst {worst:.2f} s")
    assert worst < BOUND_S
    with Client(b.socket, region_bytes=4 << 20) as client:
        assert client.health()["status"] == "ok"
        counts = client.stats()["metrics"]["cluster"]
        print(f"B: {counts.get('fetch_errors', 0)} failed fetches")
        assert counts.get("fetch_errors", 0) >= 1, "no fetch met the dead peer's segment"
        # B's own store still serves: a prompt put on B is a local hit
        assert client.put(IDENTITY, tokens(99), blocks(99)).stored == BLOCKS
        loaded = client.load(IDENTITY, tokens(99))
        assert [bytes(v) for v in loaded.views] == blocks(99)
        loaded.release()
