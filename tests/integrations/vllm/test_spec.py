"""PrefixdOffloadingSpec driven as vLLM's OffloadingConnector drives it (direct.py), against a real
daemon: chunks go from one engine's KV cache to prefixd and into another's, and a hit, once
answered, is held verified in the scheduler's region until its load, so nothing that happens to
the daemon or the store after a lookup can fail a load (vLLM stops the engine on a failed load)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
import torch
from vllm.v1.kv_offload.base import Medium, OffloadingEvent

from prefixd.client import Client
from prefixd.errors import DaemonUnavailableError, RegionError
from prefixd.schema.chain import chain_hashes
from prefixd.schema.keys import pack_keys

from ...daemon.conftest import Daemon, DaemonFactory
from ...store.test_faults import corrupt_stored_chunk
from ...waiting import wait_for
from .direct import CHUNK_BYTES, PER, Direct, load_elsewhere
from .harness import context, request_keys


class Engines:
    """The engines a test starts, closed after it."""

    def __init__(self) -> None:
        self.started: list[Direct] = []

    def start(self, socket: object, **settings: object) -> Direct:
        engine = Direct.start(socket, **settings)
        self.started.append(engine)
        return engine


@pytest.fixture
def engines() -> Iterator[Engines]:
    started = Engines()
    yield started
    for engine in started.started:
        engine.close()


def stored(engines: Engines, daemon: Daemon, n: int, seed: int) -> tuple[list[bytes], list[bytes]]:
    """`n` chunks stored by an engine of their own: the keys, and each block's bytes."""
    keys = request_keys(seed, n)
    blocks = list(range(PER * n))
    engine = engines.start(daemon.socket)
    data = engine.fill(blocks, seed)
    assert engine.store(context(f"store-{seed}", keys), keys, blocks) == keys
    return keys, data


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_fresh_engine_loads_what_another_stored_into_its_kv_cache(
    daemon: Daemon, engines: Engines, device: str
) -> None:
    """On CUDA the KV cache is device memory: the payloads cross from the registered region in
    one copy per run and are scattered on the device (stores: gathered there, then one copy)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    keys = request_keys(1, 5)
    blocks = list(range(PER * 5))
    first = engines.start(daemon.socket, device=device)
    data = first.fill(blocks, 1)
    assert first.store(context("a", keys), keys, blocks) == keys
    fresh = engines.start(daemon.socket, device=device)
    ctx = context("b", keys)
    assert fresh.settle(ctx, keys) == 5
    into = list(range(20, 20 + PER * 5))
    fresh.load(ctx, keys, into)
    assert fresh.blocks(into) == data
    assert fresh.held() == (0, 0)  # loaded: the region's space is free again


def test_a_worker_in_a_process_of_its_own_loads_what_the_scheduler_holds(
    daemon: Daemon, engines: Engines
) -> None:
    """vLLM's workers are processes of their own with more than one rank: the load spec crosses
    pickled, and the worker maps the scheduler's region through /proc."""
    keys, data = stored(engines, daemon, 3, seed=11)
    scheduler = engines.start(daemon.socket)
    ctx = context("b", keys)
    assert scheduler.settle(ctx, keys) == 3
    spec = pickle.loads(pickle.dumps(scheduler.manager.prepare_load(keys, ctx)))
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        loaded = pool.submit(load_elsewhere, str(daemon.socket), spec, list(range(PER * 3)))
        assert loaded.result(timeout=120) == data
    scheduler.manager.complete_load(keys, ctx)
    assert scheduler.held() == (0, 0)


def test_a_load_from_inside_a_chunk_copies_only_the_blocks_asked_for(
    daemon: Daemon, engines: Engines
) -> None:
    keys, data = stored(engines, daemon, 3, seed=2)
    fresh = engines.start(daemon.socket)
    ctx = context("b", keys)
    assert fresh.settle(ctx, keys) == 3
    into = list(range(40, 40 + PER * 3 - 1))  # the first chunk's first block is cached already
    fresh.load(ctx, keys, into, skip=1)
    assert fresh.blocks(into) == data[1:]
    assert fresh.blocks([39]) == [bytes(sum(t.shape[1] for t in fresh.kv))]  # untouched


def test_a_hit_stays_loadable_whatever_happens_to_the_daemon_after_the_lookup(
    daemon: Daemon, engines: Engines
) -> None:
    keys, data = stored(engines, daemon, 4, seed=3)
    fresh = engines.start(daemon.socket, reconnect_s=0.0, timeout_s=0.5)
    ctx = context("b", keys)
    assert fresh.settle(ctx, keys) == 4
    assert fresh.held() == (4, 4 * CHUNK_BYTES)
    with Client(daemon.socket) as client:
        assert client.purge(tenant="default")["blocks"] == 4  # gone from the store...
    daemon.restart()  # ...and the daemon restarted
    more, more_data = stored(engines, daemon, 2, seed=30)
    os.kill(daemon.pid, signal.SIGSTOP)  # then silent: the manager drops its connection
    try:
        assert fresh.settle(context("c", more), more) == 0
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    # connected again, with a new region, for these hits
    wait_for(lambda: fresh.settle(context(uuid.uuid4().hex, more), more) == 2, "a new region")
    newer = context("d", more)
    assert fresh.settle(newer, more) == 2
    fresh.load(ctx, keys, list(range(30, 30 + PER * 4)))  # from the old region, still held
    assert fresh.blocks(list(range(30, 30 + PER * 4))) == data
    fresh.load(newer, more, list(range(50, 50 + PER * 2)))
    assert fresh.blocks(list(range(50, 50 + PER * 2))) == more_data


def test_a_loaded_hit_is_not_held_again(daemon: Daemon, engines: Engines) -> None:
    """vLLM looks a request's keys up again at every step while the daemon is asked: once loaded,
    none of those lookups brings the chunks back into the region."""
    keys, _ = stored(engines, daemon, 3, seed=12)
    more, _ = stored(engines, daemon, 2, seed=13)
    fresh = engines.start(daemon.socket)
    ctx = context("b", keys)
    fresh.manager.on_new_request(ctx)
    assert fresh.lookup(ctx, keys) is None  # asked...
    fresh.step()
    assert fresh.lookup(ctx, keys) in (None, 3)  # ...and looked up again while it is asked
    assert fresh.settle(ctx, keys) == 3
    fresh.load(ctx, keys, list(range(PER * 3)))
    assert fresh.held() == (0, 0)
    assert fresh.settle(context("c", more), more) == 2
    assert fresh.held() == (2, 2 * CHUNK_BYTES)  # only the new request's


def test_a_request_that_ends_unloaded_gives_its_held_chunks_back(
    daemon: Daemon, engines: Engines
) -> None:
    keys, _ = stored(engines, daemon, 3, seed=4)
    fresh = engines.start(daemon.socket)
    ctx = context("b", keys)
    assert fresh.settle(ctx, keys) == 3
    assert fresh.held()[0] == 3
    fresh.manager.on_request_finished(ctx)
    assert fresh.held() == (0, 0)


@pytest.mark.damages_store
def test_a_damaged_chunk_ends_the_hit_before_it(daemon: Daemon, engines: Engines) -> None:
    keys, data = stored(engines, daemon, 4, seed=5)
    identity = engines.started[0].spec.identities[0][0]
    hashes = chain_hashes(identity, pack_keys(identity, keys))
    daemon.stop()
    corrupt_stored_chunk(daemon.data_dir, hashes[2])
    daemon.start()
    fresh = engines.start(daemon.socket)
    ctx = context("b", keys)
    assert fresh.settle(ctx, keys) == 2  # verified at the lookup: the hit ends before it
    into = list(range(10, 10 + PER * 2))
    fresh.load(ctx, keys[:2], into)
    assert fresh.blocks(into) == data[: PER * 2]


def test_a_daemon_that_is_away_is_a_miss_and_a_store_is_logged(
    daemon_factory: DaemonFactory, engines: Engines, caplog: pytest.LogCaptureFixture
) -> None:
    daemon = daemon_factory()
    keys = request_keys(6, 2)
    engine = engines.start(daemon.socket, reconnect_s=0.0)
    engine.fill(list(range(PER * 2)), 6)
    daemon.stop()
    with caplog.at_level(logging.ERROR, logger="prefixd.integrations.link"):
        engine.store(context("a", keys), keys, list(range(PER * 2)))  # done, as vLLM needs
    assert any("prefixd spec worker" in r.getMessage() for r in caplog.records)
    assert engine.settle(context("b", keys), keys) == 0


def test_a_store_larger_than_the_store_region_stores_what_fits_and_says_so(
    daemon: Daemon, engines: Engines, caplog: pytest.LogCaptureFixture
) -> None:
    keys = request_keys(14, 4)
    engine = engines.start(daemon.socket, store_region_bytes=2 * CHUNK_BYTES)
    engine.fill(list(range(PER * 4)), 14)
    with caplog.at_level(logging.WARNING, logger="prefixd.integrations.vllm.worker"):
        engine.store(context("a", keys), keys, list(range(PER * 4)))  # never waits for room
    assert any("store region is full" in r.getMessage() for r in caplog.records)
    assert engines.start(daemon.socket).settle(context("b", keys), keys) == 2


def test_events_report_stored_only_the_chunks_the_daemon_holds(
    daemon_factory: DaemonFactory, engines: Engines, tmp_path: Path
) -> None:
    """A store job is done for vLLM even when its puts were skipped (a full store region) or
    never reached a daemon: a router told of those chunks would send requests here for KV the
    node cannot serve."""
    keys = request_keys(15, 4)
    daemon = daemon_factory()
    engine = engines.start(
        daemon.socket, events=True, enable_kv_events=True, store_region_bytes=2 * CHUNK_BYTES
    )
    engine.fill(list(range(PER * 4)), 15)
    engine.store(context("a", keys), keys, list(range(PER * 4)))
    assert [sorted(e.keys) for e in stored_events(engine, keys)] == [sorted(keys[:2])]
    away = engines.start(tmp_path / "no-daemon.sock", events=True, enable_kv_events=True)
    away.fill(list(range(PER * 2)), 15)
    away.store(context("b", keys[:2]), keys[:2], list(range(PER * 2)))
    assert stored_events(away, keys[:2]) == []


def test_a_hit_not_worth_loading_is_recomputed_and_counted(
    daemon_factory: DaemonFactory, engines: Engines
) -> None:
    daemon = daemon_factory("--prefill-tokens-per-s", "1e9")
    keys, _ = stored(engines, daemon, 3, seed=7)
    assert engines.start(daemon.socket).settle(context("b", keys), keys) == 0
    with Client(daemon.socket) as client:
        tenants = client.stats()["metrics"]["tenants"]
    assert sum(t.get("loads_skipped", 0) for t in tenants.values()) >= 1


def test_chunks_the_daemon_holds_are_not_put_again(daemon: Daemon, engines: Engines) -> None:
    keys, _ = stored(engines, daemon, 3, seed=8)

    def puts() -> int:
        with Client(daemon.socket) as client:
            return int(client.stats()["metrics"]["latency_us"].get("put", {}).get("count", 0))

    before = puts()
    again = engines.start(daemon.socket)
    again.fill(list(range(PER * 3)), 8)
    again.store(context("again", keys), keys, list(range(PER * 3)))
    assert puts() == before


def stored_events(engine: Direct, keys: list[bytes]) -> list[OffloadingEvent]:
    """The manager's events once a lookup of `keys` settled: the staging thread confirms a
    store's keys with the daemon in turn with lookups, so every store before it is reported."""
    engine.settle(context(uuid.uuid4().hex, keys), keys)
    return list(engine.manager.take_events())


def test_events_carry_the_medium_and_removals(daemon: Daemon, engines: Engines) -> None:
    keys = request_keys(9, 2)
    engine = engines.start(daemon.socket, events=True, enable_kv_events=True)
    engine.fill(list(range(PER * 2)), 9)
    engine.store(context("a", keys), keys, list(range(PER * 2)))
    [event] = stored_events(engine, keys)
    assert (event.medium, event.removed, sorted(event.keys)) == (
        Medium.STORAGE,
        False,
        sorted(keys),
    )
    with Client(daemon.socket) as client:
        client.purge(tenant="default")
    assert engine.settle(context(uuid.uuid4().hex, keys), keys) == 0
    [gone] = engine.manager.take_events()
    assert gone.removed and sorted(gone.keys) == sorted(keys)


def test_a_store_run_leased_before_a_reconnect_stores_no_other_runs_bytes(
    daemon: Daemon, engines: Engines
) -> None:
    """The worker leases a run on vLLM's thread and puts it on its put thread. After a reconnect
    between the two, the run's offsets name the new connection's region, where the next job's
    run may lie: the put is refused, never the other run's bytes stored as this one."""
    from prefixd.integrations.vllm.worker import _Put

    engine = engines.start(daemon.socket, reconnect_s=0.0)
    worker, link = engine.worker, engine.worker._link
    first = link.client()
    mine = first.try_reserve(CHUNK_BYTES)
    mine.view[:] = b"A" * CHUNK_BYTES
    link.failed(first, DaemonUnavailableError("the daemon went away"))
    second = link.client()
    other = second.try_reserve(CHUNK_BYTES)
    assert other.offset == mine.offset
    other.view[:] = b"B" * CHUNK_BYTES
    [key] = request_keys(16, 1)
    identity = worker._identities[0]
    put = _Put(mine, identity, (key,), 0, 1, CHUNK_BYTES, ())
    with pytest.raises(RegionError):
        worker._put(second, put)
    with Client(daemon.socket) as client:
        assert client.lookup(identity, [pack_keys(identity, [key])])[0].n_blocks == 0
