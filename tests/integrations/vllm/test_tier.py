"""PrefixdTier driven by vLLM's own code: a real TieringOffloadingManager over a real CPU primary
tier, the tier loaded through vLLM's `module_path` factory, and a real prefixd daemon.

Store in one manager (vLLM cascades the primary tier's rows to the tier), then look up and load
in a fresh manager with an empty primary tier: the bytes that arrive are the bytes stored."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from vllm.v1.kv_offload.base import Medium

from prefixd.client import Client
from prefixd.schema.chain import chain_hashes
from prefixd.schema.keys import pack_keys

from ...daemon.conftest import Daemon, DaemonFactory
from ...store.test_faults import corrupt_stored_chunk
from ...waiting import wait_for
from .harness import FIELDS, ROW_BYTES, Engine, context, prefixd_tier, request_keys


class Engines:
    """The engines a test starts, closed after it."""

    def __init__(self) -> None:
        self.started: list[Engine] = []

    def add(self, engine: Engine) -> Engine:
        self.started.append(engine)
        return engine

    def start(self, socket: object, **tier: Any) -> Engine:
        """An engine with a prefixd tier at `socket` (see harness.Engine.start)."""
        return self.add(Engine.start(str(socket), **tier))


@pytest.fixture
def engines() -> Iterator[Engines]:
    started = Engines()
    yield started
    for engine in started.started:
        engine.close()


def rows_of(seed: int, n: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, ROW_BYTES, dtype=np.uint8).tobytes() for _ in range(n)]


def test_a_fresh_engine_loads_what_another_stored(daemon: Daemon, engines: Engines) -> None:
    keys, payloads = request_keys(1, 6), rows_of(1, 6)
    first = engines.start(daemon.socket)
    first.store(context("a", keys), keys, payloads)
    with Client(daemon.socket) as client:
        assert client.stats()["store"]["blocks"] == 6

    second = engines.start(daemon.socket)  # an empty primary tier
    assert second.load(context("b", keys), keys) == payloads


def test_a_hit_stops_at_the_first_block_the_tier_lacks(daemon: Daemon, engines: Engines) -> None:
    keys, payloads = request_keys(2, 6), rows_of(2, 6)
    first = engines.start(daemon.socket)
    first.store(context("a", keys[:3]), keys[:3], payloads[:3])
    second = engines.start(daemon.socket)
    assert second.load(context("b", keys), keys) == payloads[:3]


def test_another_identity_is_a_miss(daemon: Daemon, engines: Engines) -> None:
    keys, payloads = request_keys(3, 2), rows_of(3, 2)
    first = engines.start(daemon.socket)
    first.store(context("a", keys), keys, payloads)
    for tier in ({"tenant": "other"}, {"identity": {**FIELDS, "weights": "w2"}}):
        other = engines.start(daemon.socket, **tier)
        assert other.load(context("b", keys), keys) == []


def test_a_hit_not_worth_loading_is_recomputed_and_counted(
    daemon_factory: DaemonFactory, engines: Engines
) -> None:
    """With a prefill faster than any load, the tier stores (what is stored is not judged) but a
    fresh engine is told to recompute, and the daemon counts the hit it held back."""
    daemon = daemon_factory("--prefill-tokens-per-s", "1e9")
    keys, payloads = request_keys(9, 4), rows_of(9, 4)
    engines.start(daemon.socket).store(context("a", keys), keys, payloads)
    with Client(daemon.socket) as client:
        assert client.stats()["store"]["blocks"] == 4
    assert engines.start(daemon.socket).load(context("b", keys), keys) == []
    with Client(daemon.socket) as client:
        tenants = client.stats()["metrics"]["tenants"]
    assert sum(t.get("loads_skipped", 0) for t in tenants.values()) >= 1


def test_a_daemon_that_is_down_is_a_miss_and_comes_back(
    daemon_factory: DaemonFactory, engines: Engines
) -> None:
    daemon = daemon_factory()
    keys, payloads = request_keys(4, 3), rows_of(4, 3)
    engine = engines.start(daemon.socket, reconnect_s=0.0)
    engine.store(context("a", keys), keys, payloads)
    daemon.stop()
    fresh = engines.start(daemon.socket, reconnect_s=0.0)
    assert fresh.load(context("b", keys), keys) == []  # misses; nothing raised
    daemon.start()
    back = engines.start(daemon.socket, reconnect_s=0.0)
    wait_for(lambda: back.load(context(uuid.uuid4().hex, keys), keys) == payloads, "reconnect")


@pytest.mark.damages_store
def test_a_damaged_payload_is_a_miss_from_that_block_on(daemon: Daemon, engines: Engines) -> None:
    keys, payloads = request_keys(5, 4), rows_of(5, 4)
    first = engines.start(daemon.socket)
    first.store(context("a", keys), keys, payloads)
    identity = first.tier._identities[0]
    blocks = chain_hashes(identity, pack_keys(identity, keys))
    daemon.stop()
    corrupt_stored_chunk(daemon.data_dir, blocks[2])
    daemon.start()
    second = engines.start(daemon.socket)
    # the tier's lookup finds all four; the load verifies and refuses the damaged one
    assert second.load(context("b", keys), keys) == payloads[:2]
    third = engines.start(daemon.socket)  # quarantined: now a miss at lookup already
    assert third.load(context("c", keys), keys) == payloads[:2]


def test_take_events_reports_what_the_tier_stored(daemon: Daemon, engines: Engines) -> None:
    keys, payloads = request_keys(6, 3), rows_of(6, 3)
    engine = engines.add(
        Engine.with_tier(prefixd_tier(str(daemon.socket), enable_kv_events=True), events=True)
    )
    engine.store(context("a", keys), keys, payloads)
    events = list(engine.tier.take_events())
    assert [sorted(e.keys) for e in events] == [sorted(keys)]
    assert all(e.medium is Medium.STORAGE and not e.removed for e in events)
    assert list(engine.tier.take_events()) == []  # taken once
    quiet = engines.start(daemon.socket)  # events off: none kept
    quiet.store(context("b", request_keys(7, 2)), request_keys(7, 2), rows_of(7, 2))
    assert list(quiet.tier.take_events()) == []


def test_blocks_found_gone_are_reported_removed(daemon: Daemon, engines: Engines) -> None:
    keys, payloads = request_keys(8, 3), rows_of(8, 3)
    engine = engines.add(
        Engine.with_tier(prefixd_tier(str(daemon.socket), enable_kv_events=True), events=True)
    )
    engine.store(context("a", keys), keys, payloads)
    assert [e.removed for e in engine.tier.take_events()] == [False]
    with Client(daemon.socket) as client:
        assert client.purge(tenant="default")["blocks"] == 3
    # the tier's own lookup (what vLLM's async lookup thread calls) finds them gone
    assert engine.tier.present(keys, context("b", keys)) == [False] * 3
    [removed] = engine.tier.take_events()
    assert removed.removed and sorted(removed.keys) == sorted(keys)
    assert engine.tier.present(keys, context("c", keys)) == [False] * 3
    assert list(engine.tier.take_events()) == []  # reported once


def test_chunks_stored_again_are_not_copied_again(daemon: Daemon, engines: Engines) -> None:
    keys, payloads = request_keys(9, 4), rows_of(9, 4)

    def puts() -> int:
        with Client(daemon.socket) as client:
            latency = client.stats()["metrics"]["latency_us"]
        return int(latency.get("put", {}).get("count", 0))

    first = engines.start(daemon.socket)
    first.store(context("a", keys), keys, payloads)
    assert puts() == 1
    again = engines.start(daemon.socket)  # another engine computes and offloads them too
    again.store(context("b", keys), keys, payloads)
    assert puts() == 1  # found stored: no payload staged, no put
    more = request_keys(9, 6)
    again.store(context("c", more), more[4:], rows_of(10, 2))
    assert puts() == 2


def test_a_daemon_that_does_not_answer_is_a_miss(
    daemon_factory: DaemonFactory, engines: Engines
) -> None:
    daemon = daemon_factory()
    keys, payloads = request_keys(11, 3), rows_of(11, 3)
    engine = engines.start(daemon.socket, timeout_s=0.5, reconnect_s=0.0)
    engine.store(context("a", keys), keys, payloads)
    fresh = engines.start(daemon.socket, timeout_s=0.5, reconnect_s=0.0)
    wait_for(lambda: fresh.tier.connected, "the tier to connect")
    os.kill(daemon.pid, signal.SIGSTOP)  # alive, holding its socket, answering nothing
    try:
        assert fresh.load(context("b", keys), keys) == []  # timed out: misses, nothing raised
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    later = engines.start(daemon.socket, timeout_s=0.5, reconnect_s=0.0)
    wait_for(lambda: later.load(context(uuid.uuid4().hex, keys), keys) == payloads, "answers")
