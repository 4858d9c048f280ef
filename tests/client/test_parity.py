"""One suite for both clients: the same calls give the same results and raise the same errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from prefixd.client import Lookup, StateLookup
from prefixd.errors import (
    IdentityError,
    OpenTailError,
    OrphanBlockError,
    RegionError,
    RegionFullError,
    UnknownOperationError,
)
from prefixd.schema.chain import packed_hashes
from prefixd.schema.state import StateGroup
from tests.daemon.conftest import IDENTITY, Daemon, DaemonFactory, make_identity

from .harness import DEADLINE_S, KINDS, opener

BT = IDENTITY.block_tokens
HYBRID = make_identity(state=(StateGroup.paged("kv", page_blocks=1), StateGroup.checkpoint("rec")))


@pytest.fixture(scope="module")
def shared_daemon(module_daemon_factory: DaemonFactory) -> Daemon:
    return module_daemon_factory()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_client(kind: str) -> Callable[..., Any]:
    return opener(kind)


@pytest.fixture
def seed(kind: str) -> int:
    """Prompts of their own for each client (they share one daemon)."""
    return 1 + 1000 * KINDS.index(kind)


def tokens(seed: int, n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) * 11 + seed * 99_991).astype(np.uint32)


def blocks(seed: int, n: int, size: int = 512) -> list[bytes]:
    return [bytes([(seed * 7 + i) % 251]) * (size + 8 * i) for i in range(n)]


def test_put_lookup_load_and_hot(
    shared_daemon: Daemon, open_client: Callable[..., Any], seed: int
) -> None:
    prompt, pays = tokens(seed, 6 * BT), blocks(seed, 6)
    with open_client(shared_daemon.socket, region_bytes=1 << 16) as client:
        stored = client.put(IDENTITY, prompt, pays)
        assert (stored.stored, stored.existed) == (6, 0)
        assert client.put(IDENTITY, prompt, pays).existed == 6
        [hit, miss] = client.lookup(IDENTITY, [prompt, tokens(seed + 1, 2 * BT)])
        assert hit == Lookup(6, 6 * BT, tuple(len(p) for p in pays))
        assert hit.est_load_s > 0 and hit.est_prefill_s > 0  # the benefit rule's inputs
        assert miss == Lookup(0, 0, ())
        with client.load(IDENTITY, prompt) as loaded:
            assert [bytes(v) for v in loaded.views] == pays
        with pytest.raises(ValueError):
            bytes(loaded.views[0])  # released: raises, never shows reused bytes
        part = client.load(IDENTITY, prompt, max_blocks=2, first_block=1)
        assert (part.first_block, [bytes(v) for v in part.views]) == (1, pays[1:3])
        part.release()
        hashes = packed_hashes(IDENTITY, prompt)
        assert client.lookup(IDENTITY, [prompt], hashes=[hashes]) == [hit]
        hot = client.hot(1 << 30, tenant=IDENTITY.tenant)
        assert any(np.array_equal(p.tokens, prompt) for p in hot)
        usage = client.region_usage()
        assert usage.leases == 0 and usage.free_bytes == 1 << 16


def test_reserve_and_put_spans(
    shared_daemon: Daemon, open_client: Callable[..., Any], seed: int
) -> None:
    prompt, pays = tokens(seed + 200, 2 * BT), blocks(seed + 200, 2)
    with open_client(shared_daemon.socket, region_bytes=1 << 16) as client:
        lease = client.reserve(sum(map(len, pays)))
        lease.view[: len(pays[0])] = pays[0]
        lease.view[len(pays[0]) : len(pays[0]) + len(pays[1])] = pays[1]
        spans = [(lease.offset, len(pays[0])), (lease.offset + len(pays[0]), len(pays[1]))]
        assert client.put_spans(IDENTITY, prompt, spans).stored == 2
        lease.release()
        with pytest.raises(RegionError, match="not inside a lease"):
            client.put_spans(IDENTITY, prompt, spans)  # released space is no one's to publish
        with client.load(IDENTITY, prompt) as loaded:
            assert [bytes(v) for v in loaded.views] == pays


def test_try_reserve_never_waits(shared_daemon: Daemon, open_client: Callable[..., Any]) -> None:
    with open_client(shared_daemon.socket, region_bytes=1 << 16) as client:
        held = client.try_reserve(1 << 16)
        assert held is not None and held.size == 1 << 16
        assert client.try_reserve(1) is None  # full: no wait, no error
        held.release()
        again = client.try_reserve(1 << 15)
        assert again is not None
        again.release()


def test_state_groups(shared_daemon: Daemon, open_client: Callable[..., Any], seed: int) -> None:
    prompt = tokens(seed + 300, 2 * BT)
    pages, snap = blocks(seed + 300, 2), b"recurrent-state" * 10
    with open_client(shared_daemon.socket, region_bytes=1 << 16) as client:
        stored = client.put_state(
            HYBRID, prompt, paged={"kv": pages}, checkpoints={"rec": {2 * BT: snap}}
        )
        assert (stored.stored, stored.parts) == (2, 3)
        [hit] = client.lookup_state(HYBRID, [prompt])
        assert isinstance(hit, StateLookup) and hit.reusable_tokens == 2 * BT
        assert hit.est_load_s > 0 and hit.est_prefill_s > 0
        with client.load_state(HYBRID, prompt) as loaded:
            assert [bytes(p.view) for p in loaded.parts] == [*pages, snap]


def test_device_calls(shared_daemon: Daemon, open_client: Callable[..., Any], seed: int) -> None:
    prompt, pays = tokens(seed + 400, 3 * BT), blocks(seed + 400, 3, size=256)
    with open_client(shared_daemon.socket, region_bytes=1 << 16) as client:
        sources = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in pays]
        future = client.store_from(IDENTITY, prompt, sources, region_bytes=1 << 16)
        assert future.result(60).stored == 3
        dests = [torch.zeros(len(p), dtype=torch.uint8) for p in pays]
        installed = client.load_into(IDENTITY, prompt, dests, slots=2)
        assert installed.complete and [bytes(d.numpy()) for d in dests] == pays
        state_prompt = tokens(seed + 401, BT)
        client.put_state(
            HYBRID, state_prompt, paged={"kv": [b"p" * 64]}, checkpoints={"rec": {BT: b"c" * 32}}
        )
        into = {
            "kv": [torch.zeros(64, dtype=torch.uint8)],
            "rec": [torch.zeros(32, dtype=torch.uint8)],
        }
        got = client.load_state_into(HYBRID, state_prompt, into)
        assert got.reusable_tokens == BT and bytes(into["rec"][0].numpy()) == b"c" * 32
        warmed = client.warm_up(
            1 << 30,
            lambda p: [torch.zeros(s, dtype=torch.uint8) for s in p.sizes],
            tenant=IDENTITY.tenant,
        )
        assert warmed.prefixes >= 1 and warmed.bytes > 0
        usage = client.region_usage()
        assert usage.leases == 0


def test_admin_calls(shared_daemon: Daemon, open_client: Callable[..., Any]) -> None:
    with open_client(shared_daemon.socket) as client:
        assert client.health()["status"] == "ok"
        assert client.stats()["store"]["blocks"] >= 0
        assert client.verify(payloads=False)["problems"] == []
        report = client.purge(dry_run=True, tenant="nobody")
        assert report["blocks"] == 0
        assert client.call({"op": "health"})["status"] == "ok"
        assert client.server["instance"]


@pytest.mark.parametrize(
    ("case", "error"),
    [
        ("open_tail", OpenTailError),
        ("orphan", OrphanBlockError),
        ("bad_identity", IdentityError),
        ("unknown_op", UnknownOperationError),
        ("region_full", RegionFullError),
    ],
)
def test_the_same_errors(
    shared_daemon: Daemon, open_client: Callable[..., Any], case: str, error: type[Exception]
) -> None:
    prompt = tokens(500, 3 * BT)
    with open_client(shared_daemon.socket, region_bytes=4096, timeout=DEADLINE_S) as client:
        with pytest.raises(error) as info:
            if case == "open_tail":
                client.put(IDENTITY, prompt[: BT - 1], [b"x"])
            elif case == "orphan":
                client.put(IDENTITY, prompt, [b"x"], first_block=2)
            elif case == "bad_identity":
                client.call({"op": "lookup", "identity": {"model": 5}, "prompts": []})
            elif case == "unknown_op":
                client.call({"op": "no-such-op"})
            else:
                client.put(IDENTITY, prompt, [b"x" * 3000, b"y" * 3000, b"z" * 3000])
        assert type(info.value) is error
        assert client.health()["status"] == "ok"  # and the client goes on


def test_both_clients_agree_exactly(shared_daemon: Daemon) -> None:
    """The same sequence through each client gives equal results."""
    prompt, pays = tokens(600, 4 * BT), blocks(600, 4)
    results: dict[str, list[Any]] = {}
    for kind in KINDS:
        with opener(kind)(shared_daemon.socket, region_bytes=1 << 16) as client:
            got: list[Any] = []
            stored = client.put(IDENTITY, prompt, pays)
            got.append(stored.stored + stored.existed)
            got.append(client.lookup(IDENTITY, [prompt, prompt[: 2 * BT]]))
            with client.load(IDENTITY, prompt, max_blocks=3) as loaded:
                views = [bytes(v) for v in loaded.views]
                got.append((loaded.n_blocks, loaded.n_tokens, loaded.sizes, views))
            got.append(client.lookup_state(HYBRID, [prompt])[0].reusable_tokens)
            results[kind] = got
    assert results["blocking"] == results["async"]


def test_pin_unpin_delete_and_list(
    shared_daemon: Daemon, open_client: Callable[..., Any], seed: int
) -> None:
    tenant = f"listing-{seed}"
    ident = make_identity(tenant=tenant)
    prompt, pays = tokens(seed, 3 * BT), blocks(seed, 3)
    with open_client(shared_daemon.socket, region_bytes=1 << 16) as client:
        client.put(ident, prompt, pays)
        [hit] = client.lookup(ident, [prompt], pin=True)
        assert hit.n_blocks == 3
        assert client.unpin(ident, [prompt]) == 3  # one pin of each of its blocks
        assert client.unpin(ident, [prompt]) == 0
        listed, after = client.list_blocks(tenant=tenant, limit=2)
        rest, end = client.list_blocks(tenant=tenant, after=after)
        assert end is None and len(listed) == 2 and len(rest) == 1
        assert sorted(b.size for b in listed + rest) == sorted(len(p) for p in pays)
        assert all(b.identity == ident for b in listed + rest)
        assert client.delete(ident, [prompt[: 2 * BT]]) == 2  # block 1, and block 2 below it
        assert client.lookup(ident, [prompt])[0].n_blocks == 1
        [kept], _ = client.list_blocks(tenant=tenant)
        assert kept.size == len(pays[0])
