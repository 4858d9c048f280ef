"""One client shared by many asyncio tasks, and one by many threads: every byte each caller gets
back is its own, and every stored block holds its own bytes.

Each caller interleaves put, load, lookup, put_state and load_state of prompts no one else uses,
with payloads that name their prompt and block, so any crossing of region space between two
operations shows up as a wrong byte. The regions are small, so operations wait for each other's
space, and loaded results are held across other operations (each caller holds at most two, of
at most 15 KiB each: the regions hold what every caller may hold at once, and little more).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from prefixd.client import AsyncClient, Client
from prefixd.schema.state import StateGroup
from tests.daemon.conftest import IDENTITY, Daemon, make_identity

BT = IDENTITY.block_tokens
HYBRID = make_identity(state=(StateGroup.paged("kv", page_blocks=1), StateGroup.checkpoint("rec")))
TASKS = 8
THREADS = 6
ROUNDS = 10


def prompt_of(worker: int, round_: int, n_blocks: int) -> np.ndarray:
    seed = 1 + worker * 100 + round_
    return (np.arange(n_blocks * BT, dtype=np.int64) * 7 + seed * 1_000_003).astype(np.uint32)


def block_bytes(worker: int, round_: int, index: int, kind: int = 0) -> bytes:
    """A payload that says whose it is: no two (worker, round, index, kind) share bytes."""
    size = 1024 + 512 * ((worker + round_ + index) % 5)
    head = np.array([kind, worker, round_, index], dtype=np.uint32).tobytes()
    rng = np.random.default_rng([kind, worker, round_, index])
    return head + rng.integers(0, 256, size - len(head), dtype=np.uint8).tobytes()


class Plan:
    """What one caller does in round r, and what it expects back."""

    def __init__(self, worker: int, round_: int) -> None:
        self.n = 2 + (worker + round_) % 4
        self.prompt = prompt_of(worker, round_, self.n)
        self.blocks = [block_bytes(worker, round_, i) for i in range(self.n)]
        self.hybrid = round_ % 3 == 0
        self.state_prompt = prompt_of(worker + 50, round_, 2)
        self.pages = [block_bytes(worker, round_, i, kind=1) for i in range(2)]
        self.checkpoint = block_bytes(worker, round_, 9, kind=2)


def plans(offset: int, workers: int) -> Iterator[tuple[int, int]]:
    for w in range(offset, offset + workers):
        for r in range(ROUNDS):
            yield w, r


def check_loaded(loaded: Any, expected: list[bytes]) -> None:
    got = [bytes(v) for v in loaded.views]
    assert got == expected, "a load returned bytes that are not its own"


def check_state(loaded: Any, plan: Plan) -> None:
    got = [(p.group, bytes(p.view)) for p in loaded.parts]
    want = [("kv", plan.pages[0]), ("kv", plan.pages[1]), ("rec", plan.checkpoint)]
    assert got == want, "a state load returned bytes that are not its own"


async def async_worker(client: AsyncClient, worker: int) -> int:
    held = None
    for r in range(ROUNDS):
        plan = Plan(worker, r)
        stored = await client.put(IDENTITY, plan.prompt, plan.blocks)
        assert stored.stored + stored.existed == plan.n
        [hit] = await client.lookup(IDENTITY, [plan.prompt])
        assert hit.sizes == tuple(len(b) for b in plan.blocks)
        loaded = await client.load(IDENTITY, plan.prompt)
        check_loaded(loaded, plan.blocks)
        if plan.hybrid:
            await client.put_state(
                HYBRID,
                plan.state_prompt,
                paged={"kv": plan.pages},
                checkpoints={"rec": {2 * BT: plan.checkpoint}},
            )
            state = await client.load_state(HYBRID, plan.state_prompt)
            check_state(state, plan)
            state.release()
        if held is not None:  # a result held across this round's operations is still right
            check_loaded(held[0], held[1])
            held[0].release()
        held = (loaded, plan.blocks)
    if held is not None:
        held[0].release()
    return ROUNDS


def thread_worker(client: Client, worker: int, errors: list[BaseException]) -> None:
    try:
        held = None
        for r in range(ROUNDS):
            plan = Plan(worker, r)
            stored = client.put(IDENTITY, plan.prompt, plan.blocks)
            assert stored.stored + stored.existed == plan.n
            loaded = client.load(IDENTITY, plan.prompt)
            check_loaded(loaded, plan.blocks)
            [hit] = client.lookup(IDENTITY, [plan.prompt])
            assert hit.n_blocks == plan.n
            if plan.hybrid:
                client.put_state(
                    HYBRID,
                    plan.state_prompt,
                    paged={"kv": plan.pages},
                    checkpoints={"rec": {2 * BT: plan.checkpoint}},
                )
                with client.load_state(HYBRID, plan.state_prompt) as state:
                    check_state(state, plan)
            if held is not None:
                check_loaded(held[0], held[1])
                held[0].release()
            held = (loaded, plan.blocks)
        if held is not None:
            held[0].release()
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_one_client_shared_by_tasks_and_threads_never_crosses_bytes(daemon: Daemon) -> None:
    async def tasks() -> list[int]:
        async with AsyncClient(daemon.socket, region_bytes=320 << 10) as client:
            return await asyncio.gather(*(async_worker(client, w) for w in range(TASKS)))

    errors: list[BaseException] = []
    with Client(daemon.socket, region_bytes=256 << 10) as shared:
        threads = [
            threading.Thread(target=thread_worker, args=(shared, TASKS + w, errors))
            for w in range(THREADS)
        ]
        for thread in threads:
            thread.start()
        rounds = asyncio.run(tasks())  # the tasks run while the threads do
        for thread in threads:
            thread.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors[0]
        assert rounds == [ROUNDS] * TASKS
        usage = shared.region_usage()
        assert usage is not None and usage.leases == 0  # everything came back

    with Client(daemon.socket, region_bytes=1 << 20) as checker:
        report = checker.verify()
        assert report["problems"] == [], report
        for worker, round_ in plans(0, TASKS + THREADS):
            plan = Plan(worker, round_)
            with checker.load(IDENTITY, plan.prompt) as loaded:
                check_loaded(loaded, plan.blocks)  # every stored block holds its own bytes
            if plan.hybrid:
                with checker.load_state(HYBRID, plan.state_prompt) as state:
                    check_state(state, plan)
