"""LMCache's own drivers with prefixd behind the node server (lmcache 0.5.6): `lmcache bench l2`
with every byte verified, and `lmcache bench server` across a node-server restart, a daemon
restart and a damaged payload, every retrieved chunk's checksum equal to the stored one's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from prefixd import Store
from prefixd.client import Client
from prefixd.schema.chain import chain_hashes

from ...daemon.conftest import Daemon, DaemonFactory
from ...store.test_faults import corrupt_stored_chunk
from .node import NodeServer, bench_l2, plugin_json

SEQS = 3  # requests of 2 chunks each


def test_lmcache_bench_l2_verifies_every_byte_through_prefixd(daemon: Daemon) -> None:
    done = bench_l2(plugin_json(daemon.socket), "--num-keys", "16", "--data-size-kb", "512")
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "All 16 keys data verified OK" in done.stdout, done.stdout[-4000:]
    report, _ = json.JSONDecoder().raw_decode(done.stdout[done.stdout.index("{") :])
    ops = [op for op in report["metrics"].values() if "operation" in op]
    assert {op["operation"] for op in ops} == {"Store", "Lookup", "Load"}
    for op in ops:
        assert op["total_success"] == op["total_keys"] == 16, op
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        stats = client.stats()
    # the bench stored a warm-up and a measured round of 16 keys each, in prefixd
    assert stats["store"]["blocks"] == 32
    assert stats["metrics"]["tenants"]["lmcache"]["stored_bytes"] == 32 * 512 * 1024


@pytest.fixture
def node(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[tuple[Daemon, NodeServer]]:
    daemon = daemon_factory()
    server = NodeServer(tmp_path, plugin_json(daemon.socket))
    try:
        yield daemon, server.start()
    finally:
        server.close()


def test_the_node_server_restarts_and_every_retrieved_checksum_is_the_stored_one(
    node: tuple[Daemon, NodeServer],
) -> None:
    daemon, server = node
    first = server.bench(0, SEQS)
    stored = {seq: first.checksums[(seq, "cold")] for seq in range(SEQS)}
    for seq in range(SEQS):
        assert first.hits[(seq, "cold")] == (0, 2), first.story
        assert first.checksums.get((seq, "warm")) == stored[seq], first.story

    server.stop()  # L1 is gone with the process: hits can only come from prefixd
    server.start()
    after_server = server.bench(0, SEQS)
    for seq in range(SEQS):
        assert after_server.hits[(seq, "cold")] == (2, 2), after_server.story
        assert after_server.checksums.get((seq, "warm")) == stored[seq]

    server.stop()
    daemon.restart()
    server.start()
    after_daemon = server.bench(0, SEQS)
    for seq in range(SEQS):
        assert after_daemon.hits[(seq, "cold")] == (2, 2), after_daemon.story
        assert after_daemon.checksums.get((seq, "warm")) == stored[seq]

    # a damaged payload: a miss (recomputed and stored again by the client), never its bytes
    server.stop()
    daemon.stop()
    with Store.open(daemon.data_dir) as opened:
        blocks, _ = opened.list_blocks(tenant="lmcache")
        assert len(blocks) == 2 * SEQS
        [damaged] = chain_hashes(blocks[0].identity, blocks[0].tokens)
    corrupt_stored_chunk(daemon.data_dir, damaged)
    daemon.start()
    server.start()
    damaged_run = server.bench(0, SEQS)
    hits = [damaged_run.hits[(seq, "cold")] for seq in range(SEQS)]
    # one request lost its damaged chunk (and, by prefix, any chunk after it); the others hit
    assert sum(h == (2, 2) for h in hits) == SEQS - 1 and sum(h[0] for h in hits) < 2 * SEQS
    for seq in range(SEQS):
        assert damaged_run.checksums.get((seq, "warm")) == stored[seq], damaged_run.story
    server.stop()
    daemon.stop()
    with Store.open(daemon.data_dir) as opened:
        assert opened.stats().quarantined >= 1
