"""One clock for the store and the daemon: a daemon served in this process on a ManualClock
expires a tenant's entries and reports its uptime as that clock says, with no waiting."""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.clock import ManualClock
from prefixd.config.settings import Config
from prefixd.daemon.server import Server

from .conftest import DEADLINE_S, IDENTITY, payload, wait_for

TTL_S = 60.0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ManualClock]]:
    with serving(tmp_path) as daemon:
        yield daemon


@contextmanager
def serving(tmp_path: Path, **settings: Any) -> Iterator[tuple[Path, ManualClock]]:
    """A daemon in this process on a ManualClock, with `settings` on top of the defaults."""
    clock = ManualClock()
    sock_dir = Path(tempfile.mkdtemp(prefix="pxclk", dir="/tmp"))
    socket_path = sock_dir / "d.sock"
    config = Config.from_settings(
        data_dir=tmp_path / "data",
        socket=socket_path,
        map_size=64 << 20,
        tenant_ttls=(f"{IDENTITY.tenant}={TTL_S:g}s",),
        **settings,
    )
    server = Server(config, env={}, clock=clock)
    loop = asyncio.new_event_loop()
    codes: list[int] = []
    thread = threading.Thread(
        target=lambda: codes.append(
            loop.run_until_complete(server.serve(install_signal_handlers=False))
        ),
        daemon=True,
    )
    thread.start()
    try:
        wait_for(socket_path.exists, "the socket")
        yield socket_path, clock
    finally:
        loop.call_soon_threadsafe(server.stop)
        thread.join(DEADLINE_S)
        loop.close()
        socket_path.unlink(missing_ok=True)
        sock_dir.rmdir()
    assert codes == [0]


def test_a_tenants_time_to_live_and_the_uptime_follow_the_daemons_clock(
    served: tuple[Path, ManualClock],
) -> None:
    socket_path, clock = served
    bt = IDENTITY.block_tokens
    prompt = np.arange(3 * bt, dtype=np.uint32)
    with Client(socket_path, region_bytes=1 << 20) as client:
        client.put(IDENTITY, prompt, [payload(1, i) for i in range(3)])
        assert client.lookup(IDENTITY, [prompt])[0].n_blocks == 3
        up = client.health()["uptime_s"]
        clock.advance(TTL_S - 1)
        assert client.lookup(IDENTITY, [prompt])[0].n_blocks == 3  # not expired yet
        clock.advance(2)
        assert client.lookup(IDENTITY, [prompt])[0].n_blocks == 0  # past its time to live
        assert client.health()["uptime_s"] == pytest.approx(up + TTL_S + 1)


PROMPT = np.arange(4 * IDENTITY.block_tokens, dtype=np.uint32) + 11


def stalling_pays() -> list[bytes]:
    """Four payloads; block 1 is two reads long, inside the load's first piece."""
    from prefixd.store import codec

    sizes = [512 << 10, 2 * codec._READ_PIECE, 512 << 10, 512 << 10]
    return [bytes([i]) * size for i, size in enumerate(sizes)]


def stall_block_1(monkeypatch: pytest.MonkeyPatch, clock: ManualClock) -> None:
    """Slow storage: the clock moves ten seconds while the daemon reads block 1."""
    from prefixd.store import codec

    original = codec._pread_exactly

    def stalled(fd: int, target: memoryview, at: int) -> bool:
        done = original(fd, target, at)
        if target[0] == 1:
            clock.advance(10.0)
        return done

    monkeypatch.setattr(codec, "_pread_exactly", stalled)


def test_a_load_stalled_past_its_deadline_answers_the_verified_blocks_before_it(
    served: tuple[Path, ManualClock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slow storage: the daemon's read of block 1 stalls past the load's deadline (the clock
    moves ten seconds while it reads its first piece). The client gets block 0, verified; the
    cut-off is counted in the stats, nothing is quarantined, and a later load is whole. (Blocks
    0 and 1 are one piece of the load, read in order by one thread, and block 1 is two reads
    long: whatever the threads did with the next piece meanwhile, the answer ends where the
    first one stopped.)"""
    socket_path, clock = served
    prompt, pays = PROMPT, stalling_pays()
    with Client(socket_path, region_bytes=8 << 20) as client:
        client.put(IDENTITY, prompt, pays)
        with monkeypatch.context() as stalling:
            stall_block_1(stalling, clock)
            with client.load(IDENTITY, prompt, deadline_s=5.0) as loaded:
                assert [bytes(v) for v in loaded.views] == pays[:1]
        stats = client.stats()
        assert stats["store"]["deadline_cutoffs"] == 1
        assert stats["store"]["quarantined"] == 0
        with client.load(IDENTITY, prompt, deadline_s=5.0) as loaded:
            assert [bytes(v) for v in loaded.views] == pays


def test_the_daemons_load_deadline_holds_loads_that_name_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """load_deadline_s bounds every load whose client names no deadline of its own."""
    prompt, pays = PROMPT, stalling_pays()
    with serving(tmp_path, load_deadline_s=5.0) as (socket_path, clock):  # noqa: SIM117 - one context per clock
        with Client(socket_path, region_bytes=8 << 20) as client:
            client.put(IDENTITY, prompt, pays)
            stall_block_1(monkeypatch, clock)
            with client.load(IDENTITY, prompt) as loaded:
                assert [bytes(v) for v in loaded.views] == pays[:1]
            assert client.stats()["store"]["deadline_cutoffs"] == 1
