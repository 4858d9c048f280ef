"""The `route` operation: what this node would serve a prompt, and the score a cache-aware router
weighs nodes by (prefill saved less the node's queue and the hit's load, in seconds)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.daemon.routing import LoadQueue, answer
from prefixd.loadtime import LoadTimeModel

from .conftest import IDENTITY, NEUTRAL_PREFILL_TOKENS_PER_S, Daemon, wait_for

BT = IDENTITY.block_tokens


def test_a_route_answers_the_hit_and_its_worth(daemon: Daemon) -> None:
    prompt = np.arange(8 * BT, dtype=np.uint32) + 9
    with Client(daemon.socket, region_bytes=4 << 20) as client:
        client.put(IDENTITY, prompt, [b"k" * 4096] * 6)  # 6 of its 8 blocks
        routed = client.route(IDENTITY, prompt)
        assert (routed.hit_blocks, routed.hit_tokens, routed.hit_bytes) == (6, 6 * BT, 6 * 4096)
        assert routed.prefill_saved_s == pytest.approx(6 * BT / NEUTRAL_PREFILL_TOKENS_PER_S)
        assert routed.load_s > 0 and routed.loads_in_flight == 0 and routed.queue_s == 0
        assert routed.score_s == pytest.approx(routed.prefill_saved_s - routed.load_s)
        missed = client.route(IDENTITY, prompt + 1)
        assert (missed.hit_blocks, missed.hit_tokens, missed.load_s, missed.score_s) == (0, 0, 0, 0)


def test_loads_under_way_are_the_nodes_queue(daemon: Daemon) -> None:
    prompt = np.arange(64 * BT, dtype=np.uint32) + 5
    stop = threading.Event()
    with Client(daemon.socket, region_bytes=16 << 20) as client:
        client.put(IDENTITY, prompt, [b"q" * (64 << 10)] * 64)

        def loading() -> None:
            with Client(daemon.socket, region_bytes=16 << 20) as loader:
                while not stop.is_set():
                    with loader.load(IDENTITY, prompt) as loaded:
                        assert len(loaded.views) == 64

        loaders = [threading.Thread(target=loading) for _ in range(3)]
        for thread in loaders:
            thread.start()
        try:
            seen = []

            def queued() -> bool:
                seen.append(client.route(IDENTITY, prompt))
                return seen[-1].loads_in_flight >= 1 and seen[-1].queue_bytes > 0

            wait_for(queued, "a route that counts the loads under way")
        finally:
            stop.set()
            for thread in loaders:
                thread.join()
        busy = seen[-1]
        assert busy.queue_s > 0
        assert busy.score_s == pytest.approx(busy.prefill_saved_s - busy.queue_s - busy.load_s)


def test_the_queue_weighs_loads_in_flight_by_the_mean_load() -> None:
    queue = LoadQueue()
    model = LoadTimeModel(overhead_s=0.0, bandwidth=1e9)
    for _ in range(2):
        queue.started()
    queue.finished(1_000_000)  # one done: the mean load is 1 MB, one still under way
    routed = answer(1, 4, 64, 2_000_000, load_time=model, prefill_tokens_per_s=1000, queue=queue)
    assert (routed.loads_in_flight, routed.queue_bytes) == (1, 1_000_000)
    assert routed.queue_s == pytest.approx(1e-3) and routed.load_s == pytest.approx(2e-3)
    assert routed.score_s == pytest.approx(64 / 1000 - 1e-3 - 2e-3)
