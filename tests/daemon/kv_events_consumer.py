"""A KV event consumer written from vLLM's source (vllm/distributed/kv_events.py, 0.32.0), not
from prefixd's encoder: plain msgpack, the fields vLLM's structs declare, its frames
`[topic, seq, payload]` and its replay protocol. It rebuilds a node's block set from the events
alone, as a cache-aware router would."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

# vLLM's field order and required fields (fields without a default must be present)
STORED_REQUIRED = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
)
REMOVED_REQUIRED = ("block_hashes", "medium")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass
class NodeView:
    """A router's view of one node: its blocks (hash -> the BlockStored fields), per start."""

    blocks: dict[Any, dict[str, Any]] = field(default_factory=dict)
    incarnation: str | None = None
    last_seq: int = -1
    gaps: int = 0
    events: int = 0
    token_ids_seen: bool = False

    def apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return  # a replayed batch already applied
        if seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        batch = msgpack.unpackb(payload, raw=False)
        assert isinstance(batch, list) and len(batch) >= 2, batch
        ts, events = batch[0], batch[1]
        assert isinstance(ts, float) and isinstance(events, list)
        incarnation = batch[3] if len(batch) > 3 else None
        if incarnation != self.incarnation:  # a new start: the previous run's view is void
            self.blocks.clear()
            self.incarnation = incarnation
        for event in events:
            self.events += 1
            kind = event["type"]
            if kind == "BlockStored":
                for name in STORED_REQUIRED:
                    assert name in event, (name, event)
                assert event["medium"] == "STORAGE"
                if event["token_ids"]:
                    self.token_ids_seen = True
                for h in event["block_hashes"]:
                    self.blocks[h] = event
            elif kind == "BlockRemoved":
                for name in REMOVED_REQUIRED:
                    assert name in event, (name, event)
                for h in event["block_hashes"]:
                    self.blocks.pop(h, None)
            elif kind == "AllBlocksCleared":
                self.blocks.clear()
            else:
                raise AssertionError(f"unknown event type {kind!r}")


class Consumer:
    """A SUB socket on a node's publisher, healing gaps (and the start it missed) by replay."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.view = NodeView()

    def close(self) -> None:
        self.context.destroy(linger=0)

    def poll(self, timeout_s: float = 0.05) -> int:
        """Apply what has arrived; returns how many batches."""
        got = 0
        while self.sub.poll(int(timeout_s * 1000)):
            _topic, seq, payload = self.sub.recv_multipart()
            seq_n = int.from_bytes(seq, "big")
            if seq_n > self.view.last_seq + 1:
                self.replay()  # missed some: ask for them first
            self.view.apply(seq_n, payload)
            got += 1
            timeout_s = 0
        return got

    def replay(self) -> None:
        """Ask the replay endpoint for every batch after the last applied one."""
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", (self.view.last_seq + 1).to_bytes(8, "big")))
            while True:
                assert dealer.poll(10_000), "the replay endpoint did not answer"
                _empty, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return
                self.view.apply(int.from_bytes(seq, "big"), payload)
        finally:
            dealer.close(linger=0)

    def until(self, done: Any, timeout_s: float = 30.0) -> None:
        """Poll (and replay from the start once) until `done(view)` holds."""
        deadline = time.monotonic() + timeout_s
        self.replay()
        while not done(self.view):
            if time.monotonic() > deadline:
                raise AssertionError(f"the view never matched: {len(self.view.blocks)} blocks")
            self.poll()
