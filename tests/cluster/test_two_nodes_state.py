"""Hybrid models across two daemons on a Mooncake tier: node B restores node A's prefix state of
real tiny hybrid models (Qwen3-Next, Kimi Linear, DeepSeek-V4) exactly, in a fresh process, a
part damaged in the tier is never installed, and a checkpoint hung later reaches B. The two
daemons serve every test of the module (each its own identity), so counts are taken as deltas."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")

from prefixd.client import Client
from prefixd.cluster.blocks import block_key
from prefixd.cluster.mooncake import SharedTier
from prefixd.schema.chain import BlockChain
from prefixd.schema.state import StateGroup
from tests.waiting import wait_for

from ..daemon.conftest import Daemon, _factory, make_identity
from ..daemon.test_hybrid_models import restored_in_a_fresh_process, store_prefix
from ..integrations.models import BLOCK, PREFIX, TOL
from ..integrations.restore_from_daemon import DIVERGE
from .conftest import MooncakeMaster
from .test_two_nodes import cluster_counts, node_flags

HYBRIDS = ["qwen3_next", "kimi_linear", "deepseek_v4"]  # the models the issue names
EARLY = 24  # tests/daemon/test_hybrid_models.py's early checkpoint


@pytest.fixture(scope="module")
def nodes(
    tmp_path_factory: pytest.TempPathFactory, mooncake_master: MooncakeMaster
) -> Iterator[tuple[Daemon, Daemon]]:
    """Two daemons on one master for the whole module (as tests/cluster/test_two_nodes.py's)."""
    flags = node_flags(mooncake_master)
    with tempfile.TemporaryDirectory(prefix="pds") as sockdir:  # noqa: SIM117
        with _factory(tmp_path_factory.mktemp("nodes"), Path(sockdir)) as start:
            yield start(*flags, name="a"), start(*flags, name="b")


def published(node: Daemon) -> int:
    return cluster_counts(node).get("published_blocks", 0)


def wait_published(node: Daemon, n: int, before: int) -> None:
    wait_for(lambda: published(node) >= before + n, f"{n} more blocks published")


def test_a_hybrid_model_restores_exactly_from_the_other_node(
    nodes: tuple[Daemon, Daemon],
) -> None:
    a, b = nodes
    before, hits = published(a), cluster_counts(b)["remote_hit_blocks"]
    with Client(a.socket, region_bytes=16 << 20) as client:
        for family in HYBRIDS:
            store_prefix(client, family)
    wait_published(a, len(HYBRIDS) * PREFIX // BLOCK, before)
    results = restored_in_a_fresh_process("tests.integrations.restore_from_daemon", b, *HYBRIDS)
    assert list(results) == HYBRIDS
    for family, result in results.items():
        direct, replay = result["direct"], result["replay"]
        assert direct["reusable_tokens"] == PREFIX, family
        assert direct["diff"] <= TOL, family
        assert replay["reusable_tokens"] == EARLY < DIVERGE, family  # the checkpoint before
        assert replay["diff"] <= TOL, family
    counts = cluster_counts(b)
    assert counts["remote_hit_blocks"] - hits == len(HYBRIDS) * PREFIX // BLOCK
    assert counts.get("remote_verify_failures", 0) == 0


HYBRID = make_identity(
    tenant="acme",
    block_tokens=16,
    state=(
        StateGroup.paged("kv", page_blocks=2),
        StateGroup.checkpoint("ssm", policy="full"),
    ),
)


def test_a_damaged_remote_part_is_never_installed(
    nodes: tuple[Daemon, Daemon], mooncake_master: MooncakeMaster
) -> None:
    """The checkpoint hung on block 5 damaged in the tier: B installs blocks 0..3 (the page of
    blocks 4 and 5 cannot close without it) and answers the joint boundary at block 4."""
    a, b = nodes
    before, hits = published(a), cluster_counts(b)["remote_hit_blocks"]
    tokens = np.arange(16 * 8, dtype=np.uint32) + 5_000_000
    pages = [bytes([p]) * 40_000 for p in range(4)]
    snaps = {16 * (i + 1): bytes([100 + i]) * 20_000 for i in range(8)}
    with Client(a.socket, region_bytes=1 << 20) as client:
        put = client.put_state(HYBRID, tokens, paged={"kv": pages}, checkpoints={"ssm": snaps})
        assert put.stored == 8
    wait_published(a, 8, before)
    key = block_key(HYBRID, BlockChain(HYBRID, tokens).hash(5))
    with SharedTier(mooncake_master.settings(segment_bytes=0)) as tier:  # lends no memory
        value = bytearray(tier.get(key))
        value[-1000] ^= 0x01  # inside the checkpoint, the value's last part
        tier.remove(key)
        tier.put(key, bytes(value))
    with Client(b.socket, region_bytes=1 << 20) as client:
        [match] = client.lookup_state(HYBRID, [tokens])
        assert match.reusable_tokens == 64
        loaded = client.load_state(HYBRID, tokens)
        assert loaded.reusable_tokens == 64
        got = loaded.by_group()
        assert [bytes(p.view) for p in got["kv"]] == pages[:2]
        assert [bytes(p.view) for p in got["ssm"]] == [snaps[64]]
    counts = cluster_counts(b)
    assert counts["remote_verify_failures"] >= 1 and counts["remote_hit_blocks"] - hits == 4


CHOSEN = make_identity(
    tenant="acme",
    block_tokens=16,
    model="chosen",
    state=(StateGroup.paged("kv", page_blocks=2), StateGroup.checkpoint("ssm")),
)


def test_a_checkpoint_hung_later_reaches_the_other_node(nodes: tuple[Daemon, Daemon]) -> None:
    """A's put hangs a checkpoint on a block it stored earlier: the block is published again
    with it, and B's joint hit grows to that boundary."""
    a, b = nodes
    before = published(a)
    tokens = np.arange(16 * 4, dtype=np.uint32) + 7_000_000
    pages = [bytes([1]) * 30_000, bytes([2]) * 30_000]
    with Client(a.socket, region_bytes=1 << 20) as client:
        client.put_state(CHOSEN, tokens, paged={"kv": pages}, checkpoints={"ssm": {32: b"s" * 999}})
        wait_published(a, 4, before)
    with Client(b.socket, region_bytes=1 << 20) as client:
        assert client.lookup_state(CHOSEN, [tokens])[0].reusable_tokens == 32
    with Client(a.socket, region_bytes=1 << 20) as client:
        late = client.put_state(
            CHOSEN, tokens, first_block=4, checkpoints={"ssm": {64: b"t" * 999}}
        )
        assert late.parts == 1
        wait_published(a, 5, before)
    with Client(b.socket, region_bytes=1 << 20) as client:
        loaded = client.load_state(CHOSEN, tokens)
        assert loaded.reusable_tokens == 64
        assert [bytes(p.view) for p in loaded.by_group()["ssm"]] == [b"t" * 999]
