"""A small cache-aware router over several prefixd nodes, fed by their KV events.

Each node's daemon publishes its block set (`--kv-events-endpoint`, docs/events.md); the router
subscribes to every node, keeps one prefix index per node, and sends each request to the node
with the best score of the design:

    score_j = T_prefill_saved - T_queue - T_transfer

    T_prefill_saved  the tokens node j already holds (its longest stored prefix of the prompt),
                     at the engine's prefill throughput
    T_queue          the work already routed to node j and not yet done
    T_transfer       loading those blocks at the node's load bandwidth

The queue term is what keeps one hot node from taking everything: pure affinity (most cached
tokens, ties to the shortest queue) piles the hot prefixes onto one node, round robin ignores
the caches. Requests arrive on a simulated clock; a routed request really runs on its node
through the client (the hit is loaded and checked, the new blocks are put), so the index is
built from the events alone.

    python examples/router.py            # 3 local daemons, a hot-spot workload, 3 policies
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import numpy as np
import zmq

from prefixd import Identity
from prefixd.client import Client
from prefixd.daemon.events import BlockRemoved, BlockStored, EventBatch
from prefixd.schema.chain import chain_hashes

END_SEQ = (-1).to_bytes(8, "big", signed=True)
POLICIES = ("score", "affinity", "round_robin")


class NodeIndex:
    """One node's blocks, from its events: a SUB socket, gaps healed through its replay socket,
    a new start of the node (another incarnation) clears the view."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str, replay: str) -> None:
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.context, self.replay_endpoint = context, replay
        self.blocks: set[bytes] = set()
        self.incarnation = ""
        self.last_seq = -1
        self._decoder = msgspec.msgpack.Decoder(EventBatch)

    def drain(self, wait_s: float = 0.0) -> None:
        while self.sub.poll(int(wait_s * 1000)):
            _topic, seq, payload = self.sub.recv_multipart()
            if int.from_bytes(seq, "big") > self.last_seq + 1:
                self.replay()
            self._apply(int.from_bytes(seq, "big"), payload)
            wait_s = 0.0

    def replay(self) -> None:
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", (self.last_seq + 1).to_bytes(8, "big")))
            while dealer.poll(5000):
                _empty, _topic, seq, payload = dealer.recv_multipart()
                if seq == END_SEQ:
                    return
                self._apply(int.from_bytes(seq, "big"), payload)
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        if seq <= self.last_seq:
            return
        self.last_seq = seq
        batch = self._decoder.decode(payload)
        if batch.incarnation != self.incarnation:
            self.blocks.clear()
            self.incarnation = batch.incarnation
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.blocks.update(h for h in event.block_hashes if isinstance(h, bytes))
            elif isinstance(event, BlockRemoved):
                self.blocks.difference_update(event.block_hashes)
            else:
                self.blocks.clear()

    def hit_blocks(self, hashes: Sequence[bytes]) -> int:
        """The node's longest stored prefix of the chain `hashes`."""
        n = 0
        while n < len(hashes) and hashes[n] in self.blocks:
            n += 1
        return n


@dataclass
class Costs:
    """The simulated engine: prefill throughput and the KV bytes a block loads."""

    prefill_tokens_per_s: float = 10_000.0
    load_bytes_per_s: float = 2e9
    kv_bytes_per_block: int = 2 << 20  # 16 tokens of an 8B model's KV (128 KiB a token)


@dataclass
class Tally:
    prompt_tokens: int = 0
    hit_tokens: int = 0
    work_s: list[float] = field(default_factory=list)
    waits_s: list[float] = field(default_factory=list)
    requests: list[int] = field(default_factory=list)


class Router:
    def __init__(
        self, nodes: list[NodeIndex], policy: str, costs: Costs, block_tokens: int
    ) -> None:
        self.nodes, self.policy, self.costs, self.block_tokens = nodes, policy, costs, block_tokens
        self.busy_until = [0.0] * len(nodes)
        self._next = 0

    def pick(self, hashes: Sequence[bytes], now: float) -> tuple[int, int]:
        """(node, its hit blocks) for a prompt whose closed blocks are `hashes`."""
        hits = [node.hit_blocks(hashes) for node in self.nodes]
        queues = [max(0.0, busy - now) for busy in self.busy_until]
        if self.policy == "round_robin":
            chosen, self._next = self._next, (self._next + 1) % len(self.nodes)
        elif self.policy == "affinity":
            chosen = max(range(len(hits)), key=lambda j: (hits[j], -queues[j]))
        else:
            chosen = max(range(len(hits)), key=lambda j: (self.score(hits[j], queues[j]), -j))
        return chosen, hits[chosen]

    def score(self, hit_blocks: int, queue_s: float) -> float:
        saved = hit_blocks * self.block_tokens / self.costs.prefill_tokens_per_s
        transfer = hit_blocks * self.costs.kv_bytes_per_block / self.costs.load_bytes_per_s
        return saved - queue_s - transfer

    def service_s(self, prompt_tokens: int, hit_blocks: int) -> float:
        """What the node's engine spends on the request: load the hit, prefill the rest."""
        hit_tokens = hit_blocks * self.block_tokens
        load = hit_blocks * self.costs.kv_bytes_per_block / self.costs.load_bytes_per_s
        return load + (prompt_tokens - hit_tokens) / self.costs.prefill_tokens_per_s

    def run(
        self,
        clients: list[Client],
        identity: Identity,
        prompts: Sequence[np.ndarray],
        interarrival_s: float,
    ) -> Tally:
        tally = Tally(work_s=[0.0] * len(self.nodes), requests=[0] * len(self.nodes))
        for i, prompt in enumerate(prompts):
            now = i * interarrival_s
            for node in self.nodes:
                node.drain()
            hashes = chain_hashes(identity, prompt)
            j, hit = self.pick(hashes, now)
            with clients[j].load(identity, prompt) as loaded:  # the hit, verified
                hit = min(hit, len(loaded.views))
            missing = len(hashes) - hit
            if missing:
                payloads = [h * 64 for h in hashes[hit:]]  # 1 KiB stands for the block's KV
                clients[j].put(identity, prompt, payloads, first_block=hit)
                self.nodes[j].drain(wait_s=0.0)
                deadline = time.monotonic() + 5.0
                while hashes[-1] not in self.nodes[j].blocks and time.monotonic() < deadline:
                    self.nodes[j].drain(wait_s=0.01)
            service = self.service_s(len(prompt), hit)
            start = max(now, self.busy_until[j])
            self.busy_until[j] = start + service
            tally.waits_s.append(start - now)
            tally.work_s[j] += service
            tally.requests[j] += 1
            tally.prompt_tokens += len(prompt)
            tally.hit_tokens += hit * self.block_tokens
        return tally


def summary(tally: Tally) -> dict[str, float]:
    work = np.asarray(tally.work_s)
    waits = np.asarray(tally.waits_s)
    return {
        "token_hit_rate": round(tally.hit_tokens / max(1, tally.prompt_tokens), 3),
        "load_skew": round(float(work.max() / work.mean()), 3) if work.mean() else 0.0,
        "busiest_share": round(float(work.max() / work.sum()), 3) if work.sum() else 0.0,
        "wait_p50_ms": round(float(np.percentile(waits, 50)) * 1e3, 1),
        "wait_p99_ms": round(float(np.percentile(waits, 99)) * 1e3, 1),
    }


# --- the demo: local daemons and a hot-spot workload -------------------------------------------


def hot_spot(rng: np.random.Generator, block_tokens: int, requests: int) -> list[np.ndarray]:
    """Shared prefixes (32 blocks) picked by a Zipf law, one of them very hot, plus a distinct
    suffix: prefix affinity pays, and the hot prefix is more work than one node should take."""
    prefixes = [rng.integers(1, 100_000, 32 * block_tokens, dtype=np.uint32) for _ in range(24)]
    weights = 1.0 / np.arange(1, 25) ** 1.2
    weights /= weights.sum()
    picks = rng.choice(24, size=requests, p=weights)
    return [
        np.concatenate([prefixes[p], rng.integers(1, 100_000, 40, dtype=np.uint32)]) for p in picks
    ]


class LocalNode:
    """`prefixd serve` in a subprocess with KV events on, in a directory of its own."""

    def __init__(self, root: Path, name: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"pxr-{name}-"))
        self.socket = self.dir / "d.sock"
        self.events = f"ipc://{self.dir}/events"
        self.replay = f"ipc://{self.dir}/replay"
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "prefixd", "serve", "--data-dir", str(root / name),
             "--socket", str(self.socket), "--map-size", "1GiB", "--log-level", "warning",
             "--kv-events-endpoint", self.events, "--kv-events-replay-endpoint", self.replay,
             "--kv-events-tenants", "*"],
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the daemon {name} did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def compare(
    node_count: int, prompts: Sequence[np.ndarray], identity: Identity, utilization: float
) -> dict[str, dict[str, float]]:
    """Each policy on fresh nodes, the same prompts and arrivals."""
    costs = Costs()
    mean_tokens = float(np.mean([len(p) for p in prompts]))
    interarrival = mean_tokens / costs.prefill_tokens_per_s / (node_count * utilization)
    results: dict[str, dict[str, float]] = {}
    for policy in POLICIES:
        root = Path(tempfile.mkdtemp(prefix="pxr-data-"))
        nodes = [LocalNode(root, f"n{j}") for j in range(node_count)]
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            clients = [Client(n.socket, region_bytes=64 << 20) for n in nodes]
            indexes = [NodeIndex(context, n.events, n.replay) for n in nodes]
            for index in indexes:
                index.replay()
            router = Router(indexes, policy, costs, identity.block_tokens)
            results[policy] = summary(router.run(clients, identity, prompts, interarrival))
            for client in clients:
                client.close()
        finally:
            context.destroy(linger=0)
            for node in nodes:
                node.close()
            shutil.rmtree(root, ignore_errors=True)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--utilization", type=float, default=0.7)
    args = parser.parse_args(argv)
    identity = Identity(
        model="router-demo", weights="v1", tokenizer="t", template="c", rope="r",
        kv_layout="bf16", block_tokens=16, tenant="demo",
    )  # fmt: skip
    prompts = hot_spot(np.random.default_rng(11), identity.block_tokens, args.requests)
    results = compare(args.nodes, prompts, identity, args.utilization)
    print(f"{args.nodes} nodes, {args.requests} requests, utilization {args.utilization}")
    for policy, row in results.items():
        print(f"{policy:12} " + "  ".join(f"{k} {v}" for k, v in row.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
