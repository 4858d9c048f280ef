"""Two prefixd daemons sharing a Mooncake tier on loopback: node B's cold miss is served from
node A's publication, damage on the remote side is caught, a master that is down costs only
counted errors, and a tenant purged on A is purged from the tier."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixd.client import Client
from prefixd.cluster.blocks import block_key
from prefixd.cluster.mooncake import SharedTier
from prefixd.schema.chain import BlockChain
from tests.waiting import wait_for

from ..daemon.conftest import Daemon, _factory, make_identity, payload
from .conftest import MooncakeMaster

IDENTITY = make_identity(tenant="acme", block_tokens=16)
SIZE = 64 << 10


def tokens(seed: int, n_blocks: int = 6) -> np.ndarray:
    return (np.arange(16 * n_blocks, dtype=np.uint32) + 800_000_000 + seed * 10_000).astype(
        np.uint32
    )


def node_flags(master: MooncakeMaster) -> tuple[str, ...]:
    """A node on `master`: it lends a 32 MiB segment, and prefills slowly so fetches pay."""
    return (
        "--cluster-master", master.master,
        "--cluster-metadata", master.metadata,
        "--cluster-segment-bytes", "32MiB",
        "--cluster-timeout-s", "2",
        "--prefill-tokens-per-s", "100",
    )  # fmt: skip


@pytest.fixture
def nodes(tmp_path: Path, mooncake_master: MooncakeMaster) -> Iterator[tuple[Daemon, Daemon]]:
    """Two daemons on one master."""
    flags = node_flags(mooncake_master)
    with tempfile.TemporaryDirectory(prefix="pdc") as sockdir:  # noqa: SIM117
        with _factory(tmp_path, Path(sockdir)) as start:
            yield start(*flags, name="a"), start(*flags, name="b")


def put_on(node: Daemon, seed: int) -> list[bytes]:
    data = [payload(seed, i, SIZE) for i in range(6)]
    with Client(node.socket, region_bytes=1 << 20) as client:
        assert client.put(IDENTITY, tokens(seed), data).stored == 6
    return data


def cluster_counts(node: Daemon) -> dict[str, int]:
    with Client(node.socket) as client:
        return client.stats()["metrics"]["cluster"]


def wait_published(node: Daemon, n: int) -> None:
    wait_for(lambda: cluster_counts(node).get("published_blocks", 0) >= n, f"{n} blocks published")


def test_a_cold_miss_is_served_from_the_other_node(nodes: tuple[Daemon, Daemon]) -> None:
    a, b = nodes
    data = put_on(a, 1)
    wait_published(a, 6)
    with Client(b.socket, region_bytes=1 << 20) as client:
        # fetched, proven and staged, then answered; the install runs behind the answer
        [hit] = client.lookup(IDENTITY, [tokens(1)])
        assert hit.n_blocks == 6
        counts = cluster_counts(b)
        assert counts["remote_hit_blocks"] == 6 and counts["local_hit_blocks"] == 0
        assert counts["remote_staged_blocks"] == 6
        loaded = client.load(IDENTITY, tokens(1))  # from the store or the fetch buffers
        assert [bytes(v) for v in loaded.views] == data
    assert cluster_counts(b)["remote_hit_blocks"] == 6  # the load fetched nothing more
    b.restart()  # installed locally (a stop waits for the installs): it survives the restart
    with Client(b.socket, region_bytes=1 << 20) as client:
        assert client.lookup(IDENTITY, [tokens(1)])[0].n_blocks == 6
        assert cluster_counts(b).get("remote_hit_blocks", 0) == 0


def test_a_damaged_remote_copy_is_never_served(
    nodes: tuple[Daemon, Daemon], mooncake_master: MooncakeMaster
) -> None:
    a, b = nodes
    put_on(a, 2)
    wait_published(a, 6)
    key = block_key(IDENTITY, BlockChain(IDENTITY, tokens(2)).hash(2))
    with SharedTier(mooncake_master.settings(segment_bytes=0)) as tier:  # lends no memory
        value = bytearray(tier.get(key))
        value[-1000] ^= 0x01
        tier.remove(key)
        tier.put(key, bytes(value))
    with Client(b.socket, region_bytes=1 << 20) as client:
        assert client.lookup(IDENTITY, [tokens(2)])[0].n_blocks == 2  # stops before the damage
        loaded = client.load(IDENTITY, tokens(2))
        assert loaded.n_blocks == 2
    assert cluster_counts(b)["remote_verify_failures"] >= 1


def test_the_master_down_leaves_local_service_alone(
    nodes: tuple[Daemon, Daemon], master_control: MooncakeMaster
) -> None:
    _a, b = nodes
    data = put_on(b, 3)
    # connected and published first: Mooncake's `setup` holds the GIL while it waits for a
    # master that died under it (prefixd.cluster.mooncake), which a connect racing the stop
    # below could meet
    wait_published(b, 6)
    master_control.stop()
    with Client(b.socket, region_bytes=1 << 20) as client:
        started = time.monotonic()
        assert client.lookup(IDENTITY, [tokens(3), tokens(4)])[0].n_blocks == 6
        loaded = client.load(IDENTITY, tokens(3))
        assert [bytes(v) for v in loaded.views] == data
        assert client.put(IDENTITY, tokens(5), [payload(5, i, SIZE) for i in range(6)]).stored == 6
        assert time.monotonic() - started < 10  # bounded by the tier's timeout, never hung
        assert client.health()["status"] == "ok"
    counts = cluster_counts(b)
    assert counts.get("fetch_errors", 0) + counts.get("publish_errors", 0) >= 1


def test_a_tenant_purged_on_one_node_leaves_the_tier(
    nodes: tuple[Daemon, Daemon], mooncake_master: MooncakeMaster
) -> None:
    a, _ = nodes
    put_on(a, 6)
    wait_published(a, 6)
    keys = [block_key(IDENTITY, h) for h in BlockChain(IDENTITY, tokens(6)).hashes()]
    with SharedTier(mooncake_master.settings(segment_bytes=0)) as tier:
        assert all(tier.exists(k) for k in keys)
        with Client(a.socket) as client:
            assert client.purge(tenant="acme")["blocks"] == 6
        assert not any(tier.exists(k) for k in keys)
    assert cluster_counts(a)["remote_purged_objects"] == 6
