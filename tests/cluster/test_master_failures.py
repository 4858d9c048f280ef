"""The Mooncake master killed at random moments while two daemons put, publish, look up and fetch
through it, plain and hybrid prompts: both keep serving from their local stores, every request
within the tier's bound, every byte they serve the one stored; once the master is back, sharing
resumes for both kinds."""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.schema.state import StateGroup
from tests.waiting import wait_for

from ..daemon.conftest import Daemon, _factory, make_identity, payload
from .conftest import MooncakeMaster, request_bound_s

IDENTITY = make_identity(tenant="acme", block_tokens=16)
HYBRID = make_identity(
    tenant="acme",
    block_tokens=16,
    model="hybrid",
    state=(StateGroup.paged("kv", page_blocks=2), StateGroup.checkpoint("ssm", policy="full")),
)
SIZE = 32 << 10
BLOCKS = 4
TIMEOUT_S = 1.0
BOUND_S = request_bound_s(TIMEOUT_S)


def tokens(seed: int) -> np.ndarray:
    return (np.arange(16 * BLOCKS, dtype=np.uint32) + 300_000_000 + seed * 10_000).astype(np.uint32)


def blocks(seed: int) -> list[bytes]:
    return [payload(seed, i, SIZE) for i in range(BLOCKS)]


def put_state(client: Client, seed: int) -> None:
    """A hybrid prompt: a page every two blocks and a checkpoint at every boundary."""
    data = blocks(seed)
    client.put_state(
        HYBRID,
        tokens(seed),
        paged={"kv": data[::2]},
        checkpoints={"ssm": {16 * (i + 1): data[i][:1000] for i in range(BLOCKS)}},
    )


def state_ok(client: Client, seed: int) -> bool:
    """Whether the hybrid prompt's joint hit holds exactly what was put, up to its boundary."""
    loaded = client.load_state(HYBRID, tokens(seed))
    try:
        n = loaded.reusable_tokens // 16
        groups = loaded.by_group()
        data = blocks(seed)
        return not n or (
            [bytes(p.view) for p in groups["kv"]] == data[: -(-n // 2) * 2 : 2]
            and [bytes(p.view) for p in groups["ssm"]] == [data[n - 1][:1000]]
        )
    finally:
        loaded.release()


@pytest.fixture
def nodes(tmp_path: Path, master_control: MooncakeMaster) -> Iterator[tuple[Daemon, Daemon]]:
    flags = (
        "--cluster-master", master_control.master,
        "--cluster-metadata", master_control.metadata,
        "--cluster-segment-bytes", "32MiB",
        "--cluster-timeout-s", str(TIMEOUT_S),
        "--cluster-pending", "64",  # a short backlog to drain once the master is back
        "--prefill-tokens-per-s", "100",
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pdm") as sockdir:  # noqa: SIM117
        with _factory(tmp_path, Path(sockdir)) as start:
            yield start(*flags, name="a"), start(*flags, name="b")


def counts(node: Daemon) -> dict[str, int]:
    with Client(node.socket) as client:
        return client.stats()["metrics"]["cluster"]


def test_the_master_killed_at_random_moments(
    nodes: tuple[Daemon, Daemon], master_control: MooncakeMaster
) -> None:
    a, b = nodes
    rng = random.Random(20261202)
    stop = threading.Event()
    began = time.monotonic()
    latencies: list[float] = []
    failures: list[str] = []
    seeds = iter(range(1, 1_000_000))
    stored: list[int] = []  # seeds put on A (each also offered to the tier)

    def timed(call):
        started = time.monotonic()
        result = call()
        latencies.append(time.monotonic() - started)
        return result

    def node_a() -> None:
        with Client(a.socket, region_bytes=1 << 20) as client:
            while not stop.is_set():
                seed = next(seeds)
                timed(lambda: client.put(IDENTITY, tokens(seed), blocks(seed)))  # noqa: B023
                timed(lambda: put_state(client, seed))  # noqa: B023
                stored.append(seed)
                loaded = timed(lambda: client.load(IDENTITY, tokens(seed)))  # noqa: B023
                if [bytes(v) for v in loaded.views] != blocks(seed)[: loaded.n_blocks]:
                    failures.append(f"A served other bytes for {seed}")  # (or fewer: evicted)
                loaded.release()
                stop.wait(0.005)  # an engine between two prompts

    def node_b() -> None:
        with Client(b.socket, region_bytes=1 << 20) as client:
            while not stop.is_set():
                if not stored:
                    stop.wait(0.01)
                    continue
                seed = rng.choice(stored)
                # a local hit, or fetched from the tier while it answers: never wrong bytes
                loaded = timed(lambda: client.load(IDENTITY, tokens(seed)))  # noqa: B023
                if [bytes(v) for v in loaded.views] != blocks(seed)[: loaded.n_blocks]:
                    failures.append(f"B served other bytes for {seed}")
                loaded.release()
                if not timed(lambda: state_ok(client, seed)):  # noqa: B023
                    failures.append(f"B served another state for {seed}")

    workers = [threading.Thread(target=node_a), threading.Thread(target=node_b)]
    for worker in workers:
        worker.start()
    try:
        for _ in range(3):
            stop.wait(rng.uniform(0.3, 1.2))  # mid-puts, mid-fetches: wherever it falls
            master_control.stop()  # SIGTERM, then SIGKILL: its metadata is gone
            stop.wait(rng.uniform(0.2, 1.5))
            master_control.start()
        stop.wait(rng.uniform(0.5, 1.0))
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=60)
    assert not any(w.is_alive() for w in workers), "a client never got its answer"
    print(f"kills done after {time.monotonic() - began:.1f} s")
    assert not failures, failures
    assert len(latencies) > 20
    worst = max(latencies)
    p50_ms = np.median(latencies) * 1e3
    print(f"{len(latencies)} requests, p50 {p50_ms:.1f} ms, worst {worst:.2f} s")
    assert worst < BOUND_S
    for node in (a, b):
        with Client(node.socket) as client:
            assert client.health()["status"] == "ok"
    # the master is back: once A's backlog (a full queue drops) is offered, its next prompt
    # reaches B through the tier again
    back = time.monotonic()
    wait_for(lambda: counts(a).get("publish_queued", 0) == 0, "A's backlog offered")
    seed = next(seeds)
    with Client(a.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, tokens(seed), blocks(seed))
        put_state(client, seed)
    with Client(b.socket, region_bytes=1 << 20) as client:

        def shared() -> bool:
            loaded = client.load(IDENTITY, tokens(seed))
            try:
                return loaded.n_blocks == BLOCKS
            finally:
                loaded.release()

        try:
            wait_for(shared, "A's new prompt fetched by B once the master is back", poll_s=0.2)
        except AssertionError:
            print("A:", counts(a), "\nB:", counts(b))
            for node in (a, b):  # the prefixd lines (Mooncake's own are many), the last ones
                lines = [line for line in node.log().splitlines() if "prefixd" in line]
                print(f"{node.name}'s log:", *lines[-40:], sep="\n")
            raise
        print(f"shared again after {time.monotonic() - back:.1f} s")
        loaded = client.load(IDENTITY, tokens(seed))
        assert [bytes(v) for v in loaded.views] == blocks(seed)
        loaded.release()
        wait_for(
            lambda: client.lookup_state(HYBRID, [tokens(seed)])[0].reusable_tokens == 16 * BLOCKS,
            "A's new hybrid prompt fetched by B",
            poll_s=0.2,
        )
        assert state_ok(client, seed)
