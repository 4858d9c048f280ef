"""prefixd's KV events decoded by vLLM's own event classes (vllm.distributed.kv_events): the
batches a daemon publishes are vLLM's KVEventBatch, and blocks stored under vLLM's keys (the
tier's engine-keyed identity) name those keys, parents included, as a router matching them
against the engine's own events needs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import numpy as np
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from prefixd.client import Client
from prefixd.schema.chain import chain_hashes
from prefixd.schema.keys import pack_keys

from ...daemon.conftest import IDENTITY, DaemonFactory
from ...waiting import wait_for

KEYED = dataclasses.replace(IDENTITY, block_tokens=32, key_bytes=36)


def test_vllm_decodes_every_batch(daemon_factory: DaemonFactory, sock_dir: Path) -> None:
    endpoint = f"ipc://{sock_dir}/events"
    replay = f"ipc://{sock_dir}/replay"
    daemon = daemon_factory(
        "--kv-events-endpoint", endpoint, "--kv-events-replay-endpoint", replay,
        "--kv-events-tenants", "*",
    )  # fmt: skip
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    events: list[object] = []
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        tokens = np.arange(3 * IDENTITY.block_tokens, dtype=np.uint32) + 77
        keys = [bytes([k]) * 32 + (0).to_bytes(4, "big") for k in (1, 2, 3)]
        with Client(daemon.socket, region_bytes=1 << 20) as client:
            client.put(IDENTITY, tokens, [b"t" * 64] * 3)
            client.put(KEYED, pack_keys(KEYED, keys), [b"k" * 64] * 3)
            client.purge(tenant=IDENTITY.tenant)
        dealer = context.socket(zmq.DEALER)  # everything from the start, in vLLM's replay
        dealer.connect(replay)

        def replayed() -> bool:
            events.clear()
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:
                assert dealer.poll(10_000)
                _empty, _topic, seq, payload = dealer.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    break
                batch = decoder.decode(payload)  # vLLM's own class: the format is vLLM's
                assert isinstance(batch, KVEventBatch)
                events.extend(batch.events)
            return sum(isinstance(e, BlockRemoved) for e in events) == 6

        wait_for(replayed, "the stores and the purge in the replay")
    finally:
        context.destroy(linger=0)
    assert isinstance(events[0], AllBlocksCleared)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hashes[0] for e in stored[:3]] == chain_hashes(IDENTITY, tokens)
    assert stored[1].parent_block_hash == chain_hashes(IDENTITY, tokens)[0]
    assert stored[1].token_ids == tokens[IDENTITY.block_tokens : 2 * IDENTITY.block_tokens].tolist()
    assert all(e.medium == "STORAGE" and e.block_size == IDENTITY.block_tokens for e in stored[:3])
    assert [e.block_hashes[0] for e in stored[3:]] == keys  # the engine's keys, not prefixd's
    assert [e.parent_block_hash for e in stored[3:]] == [None, keys[0], keys[1]]
    assert all(e.token_ids == [] and e.block_size == 32 for e in stored[3:])
