"""Pins through the daemon: a lookup with `pin` keeps its hits from eviction until the client
unpins them or its connection ends; `delete` removes named blocks."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from prefixd import Store
from prefixd.client import Client
from prefixd.config.policy import Grant
from prefixd.daemon.context import Request, RequestContext
from prefixd.daemon.engine_ops import pinned_lookup, unpin
from prefixd.daemon.operations import Operations
from prefixd.daemon.peer import Peer, Pins
from prefixd.errors import ProtocolError
from prefixd.schema.keys import pack_keys
from prefixd.wire.errors import ErrorCode, code_of
from prefixd.wire.messages import Lookup, Prompt, Unpin, WireIdentity

from .conftest import IDENTITY, NOBODY, DaemonFactory
from .test_loop_work import services

ENGINE = dataclasses.replace(IDENTITY, key_bytes=32, block_tokens=16)
BLOCK = 64 << 10
# room for about 8 blocks, least recently read first: each fill below evicts all older blocks
SMALL = ("--capacity-bytes", str(8 * BLOCK), "--low-watermark", "0.5", "--eviction", "lru")


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 8


def one(i: int) -> bytes:
    return pack_keys(ENGINE, [key(i)])


def fill(client: Client, start: int, count: int) -> None:
    for i in range(start, start + count):
        client.put(ENGINE, one(i), [bytes([i % 251]) * BLOCK])


def stored(client: Client, i: int) -> bool:
    return client.lookup(ENGINE, [one(i)])[0].n_blocks == 1


def test_pinned_keys_survive_eviction_until_unpinned_or_disconnected(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(*SMALL)
    with Client(daemon.socket, region_bytes=4 << 20) as writer:
        fill(writer, 0, 4)
        holder = Client(daemon.socket, region_bytes=1 << 20)
        [hit0, hit1] = holder.lookup(ENGINE, [one(0), one(1)], pin=True)
        assert hit0.n_blocks == 1 and hit1.n_blocks == 1
        fill(writer, 100, 40)
        assert stored(writer, 0) and stored(writer, 1)  # pinned: never chosen
        assert not stored(writer, 2) and not stored(writer, 3)  # as old, unpinned: evicted
        assert holder.unpin(ENGINE, [one(1)]) == 1
        assert holder.unpin(ENGINE, [one(1)]) == 0  # it held one pin of it, not two
        fill(writer, 200, 40)
        assert stored(writer, 0) and not stored(writer, 1)
        holder.close()  # its connection's pins go with it
        fill(writer, 300, 40)
        assert not stored(writer, 0)


def test_one_tenants_pins_keep_at_most_a_quarter_of_the_store_from_eviction(
    daemon_factory: DaemonFactory,
) -> None:
    """A tenant that pins all it stored and never unpins: its hits stop at a quarter of the
    store's capacity, and another tenant's puts land and stay rather than being the only blocks
    eviction may take."""
    daemon = daemon_factory(*SMALL)
    hog = dataclasses.replace(ENGINE, tenant="hog")
    with (
        Client(daemon.socket, region_bytes=4 << 20) as writer,
        Client(daemon.socket, region_bytes=1 << 20) as holder,
    ):
        for i in range(6):
            writer.put(hog, one(i), [bytes([i]) * BLOCK])
        hits = holder.lookup(hog, [one(i) for i in range(6)], pin=True)
        fill(writer, 100, 40)
        assert stored(writer, 139) and stored(writer, 138)
        assert [hit.n_blocks for hit in hits] == [1, 1, 0, 0, 0, 0]  # 2 of the 8 blocks' room
        server = writer.stats()["server"]
        assert (server["pinned_bytes"], server["pins_cut_blocks"]) == (2 * BLOCK, 4)
        assert [holder.lookup(hog, [one(i)])[0].n_blocks for i in range(3)] == [1, 1, 0]
        assert holder.unpin(hog, [one(0)]) == 1
        assert writer.stats()["server"]["pinned_bytes"] == BLOCK


def test_a_pin_of_another_client_is_not_released_by_unpin(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(*SMALL)
    with (
        Client(daemon.socket, region_bytes=4 << 20) as writer,
        Client(daemon.socket, region_bytes=1 << 20) as holder,
    ):
        fill(writer, 0, 1)
        holder.lookup(ENGINE, [one(0)], pin=True)
        assert writer.unpin(ENGINE, [one(0)]) == 0
        fill(writer, 100, 40)
        assert stored(writer, 0)


def test_delete_removes_the_named_keys(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory()
    with Client(daemon.socket, region_bytes=4 << 20) as client:
        fill(client, 0, 3)
        assert client.delete(ENGINE, [one(0), one(2), one(9)]) == 2
        assert [stored(client, i) for i in range(3)] == [False, True, False]


def test_a_connections_pins_are_kept_by_tenant() -> None:
    """A reload that takes a tenant drops that tenant's pins only; an unpin names one tenant of a
    share group, whose blocks another tenant of the group may have pinned."""
    pins = Pins()
    pins.hold("alice", [b"x", b"x", b"y"], [10, 10, 1])
    pins.hold("bob", [b"x"])
    assert pins.pinned == {"alice": 21, "bob": 10}  # each pin weighs its block's bytes
    assert pins.release("bob", [b"x", b"x", b"z"]) == [b"x", b"x"]  # bob's pin, then alice's
    assert pins.pinned == {"alice": 11}
    assert sorted(pins.drop(keep=lambda tenant: tenant == "bob")) == [b"x", b"y"]
    assert not pins and not pins.pinned


def connected(store: Store, pool: ThreadPoolExecutor) -> tuple[Operations, Peer, RequestContext]:
    """The daemon's operations over `store`, and a connection of uid NOBODY to them."""
    ops = Operations(services(store, pool))
    peer = Peer(NOBODY, max_inflight=64)
    return ops, peer, ops.context(peer)


def test_a_pinning_lookup_that_a_reload_overtakes_gives_its_pins_back(tmp_path: Path) -> None:
    """The grant is checked when the lookup is read; a reload that takes the tenant before the
    store has pinned its blocks must not leave them pinned for the connection."""
    with Store.open(tmp_path / "s", map_size=64 << 20) as store, ThreadPoolExecutor(1) as pool:
        store.put(ENGINE, one(0), [b"kv"])
        ops, peer, context = connected(store, pool)
        message = Lookup(id=1, identity=WireIdentity.of(ENGINE), prompts=[Prompt(tokens=one(0))])
        queries = context.queries(message)  # allowed, when the request came
        assert ops.regrant(peer, Grant(frozenset({"other"}), frozenset())) is not None
        with pytest.raises(ProtocolError) as refused:
            asyncio.run(pinned_lookup(context, 1, queries, None))
        assert code_of(refused.value) is ErrorCode.FORBIDDEN
        assert len(store._ctx.pins) == 0 and not peer.pins


def test_a_pinning_lookup_refused_at_a_later_prompt_gives_its_pins_back(tmp_path: Path) -> None:
    """The first prompt was pinned when the second was refused (hashes that do not fit it): the
    request fails, and no pin of it outlives it, recorded for the connection or not."""
    tokens = np.arange(4 * IDENTITY.block_tokens, dtype=np.uint32).tobytes()
    with Store.open(tmp_path / "s", map_size=64 << 20) as store, ThreadPoolExecutor(1) as pool:
        store.put(IDENTITY, tokens, [b"kv"] * 4)
        _, peer, context = connected(store, pool)
        prompts = [Prompt(tokens=tokens), Prompt(tokens=tokens, hashes=b"x")]
        message = Lookup(id=1, identity=WireIdentity.of(IDENTITY), prompts=prompts)
        with pytest.raises(ProtocolError) as refused:
            asyncio.run(pinned_lookup(context, 1, context.queries(message), None, judged=False))
        assert code_of(refused.value) is ErrorCode.BAD_TOKENS
        assert len(store._ctx.pins) == 0 and not peer.pins


def test_an_unpin_weighs_on_the_loop_only_the_blocks_it_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unpin may name a prompt of millions of blocks: the blocks the connection does not hold
    are set aside on a worker, so the loop releases only the pinned ones."""
    with Store.open(tmp_path / "s", map_size=64 << 20) as store, ThreadPoolExecutor(1) as pool:
        store.put(ENGINE, one(0), [b"kv"])
        _, peer, context = connected(store, pool)
        pinning = Lookup(id=1, identity=WireIdentity.of(ENGINE), prompts=[Prompt(tokens=one(0))])
        asyncio.run(pinned_lookup(context, 1, context.queries(pinning), None, judged=False))
        weighed: list[int] = []
        release = Pins.release

        def counted(pins: Pins, tenant: str, blocks: Iterable[bytes]) -> list[bytes]:
            blocks = list(blocks)
            weighed.append(len(blocks))
            return release(pins, tenant, blocks)

        monkeypatch.setattr(Pins, "release", counted)
        long = pack_keys(ENGINE, [key(0), *(key(i) for i in range(1, 5000))])
        request = Unpin(id=2, identity=WireIdentity.of(ENGINE), prompts=[Prompt(tokens=long)])
        reply = asyncio.run(unpin(context, Request(2, request, ())))
        assert reply.released == 1 and weighed == [1]
        assert len(store._ctx.pins) == 0 and not peer.pins
