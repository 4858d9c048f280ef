"""The request traces of bench/run.py, the KV-like bytes of their blocks, and the engine loop that
drives a cache with them.

A workload is a list of prompts (uint32 token ids) under one identity. The engine loop, for each
prompt, is what an inference engine does before prefill: `lookup` the stored prefix, `load` the hit
(and check the bytes: every block's payload is a pure function of its chain hash, so the expected
bytes are known), then prefill the rest and `put` the missing closed blocks. A `Backend` is the
cache under test: the prefixd daemon through `prefixd.client.Client`, or a peer (bench/peers.py).

The traces:

* shared_prefix: one long system prompt shared by every request, then a short distinct suffix.
* chat:          multi-turn conversations picked by a Zipf law; a turn's prompt is its
                 conversation's history (every earlier prompt and reply) plus a new user message.
                 A conversation that outgrows `max_history_blocks` starts over (a new one).
* rag:           a shared instruction, then a few documents picked by a Zipf law from a pool and
                 put in a fixed order (by popularity rank), then a distinct question.
* drift:         prefixes from a pool; the popular set (Zipf within it) moves every phase, with a
                 little uniform background traffic; run under a capacity limit, so eviction
                 decides what is still there when the popular set comes back or moves on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import daemon_bench
import numpy as np
from suitelib import percentiles_us

from prefixd import Identity
from prefixd.client import Client
from prefixd.errors import PrefixdError
from prefixd.schema.chain import BlockChain

VOCAB = 128_000
ZIPF_S = 1.1


# --- traces ----------------------------------------------------------------------------------


@dataclass
class Workload:
    """`prompts` under `identity`; `phases[i]` is request i's phase (drift), else all 0."""

    name: str
    description: str
    identity: Identity
    prompts: list[np.ndarray]
    params: dict[str, Any]
    phases: list[int] = field(default_factory=list)
    capacity_bytes: int = 0  # the daemon's --capacity-bytes this workload runs under (0: none)

    @property
    def max_blocks(self) -> int:
        bt = self.identity.block_tokens
        return max(len(p) // bt for p in self.prompts)

    def unique_blocks(self) -> int:
        """Distinct closed blocks over the whole trace: what a cache without a limit ends up
        holding (hash of the whole prefix, as the chain names them)."""
        bt = self.identity.block_tokens
        seen: set[bytes] = set()
        for prompt in self.prompts:
            seen.update(BlockChain(self.identity, prompt).hashes_until(len(prompt) // bt))
        return len(seen)


def random_tokens(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, VOCAB, n, dtype=np.uint32)


def random_span(rng: np.random.Generator, low: int, high: int) -> np.ndarray:
    """Random tokens, a random number of them in [low, high]."""
    return random_tokens(rng, int(rng.integers(low, high + 1)))


def zipf_weights(n: int, s: float = ZIPF_S) -> np.ndarray:
    """P(rank k) proportional to 1 / k**s over ranks 1..n (a finite Zipf law)."""
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def shared_prefix(
    rng: np.random.Generator,
    ident: Identity,
    *,
    requests: int,
    prefix_blocks: int,
    suffix_tokens: tuple[int, int],
) -> Workload:
    bt = ident.block_tokens
    system = random_tokens(rng, prefix_blocks * bt)
    prompts = [np.concatenate([system, random_span(rng, *suffix_tokens)]) for _ in range(requests)]
    return Workload(
        "shared_prefix",
        "one long shared system prompt + a short distinct suffix per request",
        ident,
        prompts,
        {"requests": requests, "prefix_tokens": len(system), "suffix_tokens": list(suffix_tokens)},
    )


def chat(
    rng: np.random.Generator,
    ident: Identity,
    *,
    requests: int,
    conversations: int,
    system_blocks: int,
    user_tokens: tuple[int, int],
    reply_tokens: tuple[int, int],
    max_history_blocks: int,
    zipf_s: float = ZIPF_S,
) -> Workload:
    bt = ident.block_tokens
    system = random_tokens(rng, system_blocks * bt)
    histories: list[np.ndarray | None] = [None] * conversations
    picks = rng.choice(conversations, size=requests, p=zipf_weights(conversations, zipf_s))
    prompts, started = [], 0
    for c in picks:
        history = histories[c]
        if history is None or len(history) > max_history_blocks * bt:
            history, started = system, started + 1
        prompt = np.concatenate([history, random_span(rng, *user_tokens)])
        prompts.append(prompt)
        histories[c] = np.concatenate([prompt, random_span(rng, *reply_tokens)])
    return Workload(
        "chat",
        f"multi-turn chat, conversations by Zipf(s={zipf_s}), each turn extends its history",
        ident,
        prompts,
        {
            "requests": requests,
            "conversations": conversations,
            "conversations_started": started,
            "zipf_s": zipf_s,
            "system_tokens": len(system),
            "user_tokens": list(user_tokens),
            "reply_tokens": list(reply_tokens),
            "max_history_tokens": max_history_blocks * bt,
        },
    )


def rag(
    rng: np.random.Generator,
    ident: Identity,
    *,
    requests: int,
    documents: int,
    per_request: int,
    document_tokens: tuple[int, int],
    system_blocks: int,
    question_tokens: tuple[int, int],
    zipf_s: float = ZIPF_S,
) -> Workload:
    bt = ident.block_tokens
    system = random_tokens(rng, system_blocks * bt)
    pool = [random_span(rng, *document_tokens) for _ in range(documents)]
    weights = zipf_weights(documents, zipf_s)
    prompts = []
    for _ in range(requests):
        picked = np.sort(rng.choice(documents, size=per_request, replace=False, p=weights))
        question = random_span(rng, *question_tokens)
        prompts.append(np.concatenate([system, *(pool[d] for d in picked), question]))
    return Workload(
        "rag",
        f"RAG: {per_request} of {documents} shared documents by Zipf(s={zipf_s}) in rank order "
        "+ a distinct question",
        ident,
        prompts,
        {
            "requests": requests,
            "documents": documents,
            "documents_per_request": per_request,
            "zipf_s": zipf_s,
            "document_tokens": list(document_tokens),
            "system_tokens": len(system),
            "question_tokens": list(question_tokens),
        },
    )


def drift(
    rng: np.random.Generator,
    ident: Identity,
    *,
    phases: int,
    requests_per_phase: int,
    pool: int,
    hot_set: int,
    shift: int,
    prefix_blocks: int,
    suffix_tokens: tuple[int, int],
    background: float = 0.1,
    zipf_s: float = ZIPF_S,
) -> Workload:
    bt = ident.block_tokens
    prefixes = [random_tokens(rng, prefix_blocks * bt) for _ in range(pool)]
    weights = zipf_weights(hot_set, zipf_s)
    prompts, phase_of = [], []
    for phase in range(phases):
        first = phase * shift
        for _ in range(requests_per_phase):
            if rng.random() < background:
                chosen = int(rng.integers(pool))
            else:
                chosen = (first + int(rng.choice(hot_set, p=weights))) % pool
            prompts.append(np.concatenate([prefixes[chosen], random_span(rng, *suffix_tokens)]))
            phase_of.append(phase)
    return Workload(
        "drift",
        f"hot-spot drift: {phases} phases, the popular {hot_set} of {pool} prefixes move by "
        f"{shift} each phase (Zipf(s={zipf_s}) within, {background:.0%} uniform background)",
        ident,
        prompts,
        {
            "phases": phases,
            "requests_per_phase": requests_per_phase,
            "pool": pool,
            "hot_set": hot_set,
            "shift": shift,
            "prefix_tokens": prefix_blocks * bt,
            "suffix_tokens": list(suffix_tokens),
            "background": background,
            "zipf_s": zipf_s,
        },
        phases=phase_of,
    )


# --- payloads --------------------------------------------------------------------------------


class Payloads:
    """KV-like bytes (bf16 normals) of every block: a slice of one pool chosen by the block's
    chain hash, so the same block always has the same bytes and a load can be checked."""

    ALIGN = 64

    def __init__(self, payload_bytes: int, pool_bytes: int, rng: np.random.Generator) -> None:
        pool_bytes = max(pool_bytes, 4 * payload_bytes)
        self.size = payload_bytes
        self.pool = daemon_bench.make_payload_bytes(pool_bytes, rng)
        self._slots = (pool_bytes - payload_bytes) // self.ALIGN + 1

    def of(self, block_hash: bytes) -> np.ndarray:
        offset = int.from_bytes(block_hash[:8], "little") % self._slots * self.ALIGN
        return self.pool[offset : offset + self.size]


# --- the caches under test -------------------------------------------------------------------


class Backend(Protocol):
    """One cache. Per request the loop calls lookup, then load (on a hit), then put (on a miss):
    a backend may keep what lookup computed for the rest of the request."""

    name: str

    def lookup(self, ident: Identity, prompt: np.ndarray) -> int:
        """How many leading closed blocks of `prompt` are stored."""
        ...

    def load(self, ident: Identity, prompt: np.ndarray, n_blocks: int) -> Sequence[Any]:
        """The payloads of the first `n_blocks` blocks (or fewer: what is still there), as
        buffers in the backend's destination memory."""
        ...

    def put(
        self, ident: Identity, prompt: np.ndarray, first_block: int, payloads: Sequence[Any]
    ) -> None:
        """Store blocks first_block.. of `prompt`."""
        ...


class PrefixdBackend:
    """The daemon through the blocking client: loads land in the client's shared region."""

    name = "prefixd"

    def __init__(self, client: Client, payloads: Payloads) -> None:
        self.client = client
        self.payloads = payloads  # for a put that has to publish the whole prefix again
        self.put_retries = 0

    def lookup(self, ident: Identity, prompt: np.ndarray) -> int:
        return self.client.lookup(ident, [prompt])[0].n_blocks

    def load(self, ident: Identity, prompt: np.ndarray, n_blocks: int) -> Sequence[Any]:
        return self.client.load(ident, prompt, max_blocks=n_blocks).views

    def put(
        self, ident: Identity, prompt: np.ndarray, first_block: int, payloads: Sequence[Any]
    ) -> None:
        end = (first_block + len(payloads)) * ident.block_tokens
        try:
            self.client.put(ident, prompt[:end], payloads, first_block=first_block)
        except PrefixdError as exc:
            # Under a capacity limit the parent may be evicted between the load and the put:
            # publish the whole prefix instead (blocks still there count as existing).
            if exc.code != "orphan" or first_block == 0:
                raise
            self.put_retries += 1
            self.client.put(ident, prompt[:end], self._whole(ident, prompt, first_block, payloads))

    def _whole(
        self, ident: Identity, prompt: np.ndarray, first_block: int, payloads: Sequence[Any]
    ) -> list[Any]:
        hashes = BlockChain(ident, prompt).hashes_until(first_block)
        return [self.payloads.of(h) for h in hashes[:first_block]] + list(payloads)


# --- the engine loop -------------------------------------------------------------------------


@dataclass
class Tally:
    """What one backend did on one workload."""

    requests: int = 0
    requests_hit: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    closed_bytes: int = 0
    loaded_bytes: int = 0
    loaded_blocks: int = 0
    put_bytes: int = 0
    put_blocks: int = 0
    lookup_short: int = 0  # loads that found fewer blocks than their lookup (evicted between)
    hit_blocks: list[int] = field(default_factory=list)
    closed_blocks: list[int] = field(default_factory=list)
    stage_s: dict[str, list[float]] = field(
        default_factory=lambda: {"lookup": [], "load": [], "put": []}
    )
    phase_tokens: dict[int, list[int]] = field(default_factory=dict)  # phase: [hit, prompt]


def same_payload(got: Any, expected: np.ndarray) -> bool:
    return np.array_equal(np.frombuffer(got, dtype=np.uint8), expected)


def drive(backend: Backend, workload: Workload, payloads: Payloads) -> Tally:
    """Run the trace through `backend`; every loaded block is compared with its expected bytes
    (outside the timed stages)."""
    ident = workload.identity
    bt = ident.block_tokens
    tally = Tally()
    clock = time.perf_counter
    stage = tally.stage_s
    phases = workload.phases or [0] * len(workload.prompts)
    for prompt, phase in zip(workload.prompts, phases):
        closed = len(prompt) // bt
        hashes = BlockChain(ident, prompt).hashes_until(closed)  # the engine's KV, by block
        started = clock()
        hit = backend.lookup(ident, prompt)
        stage["lookup"].append(clock() - started)
        loaded = 0
        if hit:
            started = clock()
            views = backend.load(ident, prompt, hit)
            stage["load"].append(clock() - started)
            loaded = len(views)
            for i, view in enumerate(views):
                if not same_payload(view, payloads.of(hashes[i])):
                    raise RuntimeError(f"{backend.name}: block {i} of a load has wrong bytes")
                tally.loaded_bytes += len(memoryview(view).cast("B"))
            del views  # region views must not outlive the request
            tally.lookup_short += loaded < hit
        if loaded < closed:
            blocks = [payloads.of(h) for h in hashes[loaded:closed]]
            started = clock()
            backend.put(ident, prompt, loaded, blocks)
            stage["put"].append(clock() - started)
            tally.put_blocks += len(blocks)
            tally.put_bytes += len(blocks) * payloads.size
        tally.requests += 1
        tally.requests_hit += loaded > 0
        tally.prompt_tokens += len(prompt)
        tally.hit_tokens += loaded * bt
        tally.loaded_blocks += loaded
        tally.closed_bytes += closed * payloads.size
        tally.hit_blocks.append(loaded)
        tally.closed_blocks.append(closed)
        per_phase = tally.phase_tokens.setdefault(phase, [0, 0])
        per_phase[0] += loaded * bt
        per_phase[1] += len(prompt)
    return tally


# --- results ---------------------------------------------------------------------------------


def histogram(hit_blocks: Sequence[int], max_blocks: int, block_tokens: int) -> list[dict]:
    """Requests by hit length: no hit, then hits of [2**(k-1), 2**k) blocks, in tokens, up to
    the longest prompt of the trace (so every backend's histogram has the same buckets)."""
    edges = [(0, 0)]
    low = 1
    while low <= max(max_blocks, 1):
        edges.append((low, 2 * low - 1))
        low *= 2
    counts = [0] * len(edges)
    for n in hit_blocks:
        counts[0 if n == 0 else n.bit_length()] += 1
    return [
        {"min_tokens": lo * block_tokens, "max_tokens": hi * block_tokens, "requests": count}
        for (lo, hi), count in zip(edges, counts)
    ]


def summarize(
    tally: Tally, workload: Workload, prefill_tokens_per_s: float, seconds: float
) -> dict[str, Any]:
    """Hit rates, histogram, stage times, throughput and the prefill time saved."""
    bt = workload.identity.block_tokens
    stages = tally.stage_s
    stage_total = {name: sum(values) for name, values in stages.items()}
    busy = sum(stage_total.values())
    saved = tally.hit_tokens / prefill_tokens_per_s
    spent = stage_total["lookup"] + stage_total["load"]
    result: dict[str, Any] = {
        "requests": tally.requests,
        "requests_hit": tally.requests_hit,
        "prompt_tokens": tally.prompt_tokens,
        "hit_tokens": tally.hit_tokens,
        "request_hit_rate": _rate(tally.requests_hit, tally.requests),
        "token_hit_rate": _rate(tally.hit_tokens, tally.prompt_tokens),
        "byte_hit_rate": _rate(tally.loaded_bytes, tally.closed_bytes),
        "loaded_bytes": tally.loaded_bytes,
        "loaded_blocks": tally.loaded_blocks,
        "put_bytes": tally.put_bytes,
        "put_blocks": tally.put_blocks,
        "loads_shorter_than_lookup": tally.lookup_short,
        "hit_histogram": histogram(tally.hit_blocks, max(tally.closed_blocks, default=0), bt),
        "stages_us": {name: percentiles_us(values) for name, values in stages.items()},
        "stages_total_s": {name: round(value, 4) for name, value in stage_total.items()},
        "requests_per_s": round(tally.requests / busy, 1) if busy else None,
        "load_gbps": round(tally.loaded_bytes / stage_total["load"] / 1e9, 3)
        if stage_total["load"]
        else None,
        "put_gbps": round(tally.put_bytes / stage_total["put"] / 1e9, 3)
        if stage_total["put"]
        else None,
        "prefill": {
            "assumed_tokens_per_s": prefill_tokens_per_s,
            "saved_s": round(saved, 3),
            "lookup_and_load_s": round(spent, 3),
            "net_saved_s": round(saved - spent, 3),
        },
        "wall_s": round(seconds, 3),
    }
    if len(tally.phase_tokens) > 1:
        result["phase_token_hit_rates"] = [
            _rate(hit, total) for _, (hit, total) in sorted(tally.phase_tokens.items())
        ]
    return result


def _rate(part: int, whole: int) -> float:
    return round(part / whole, 4) if whole else 0.0


__all__ = [
    "Backend",
    "Payloads",
    "PrefixdBackend",
    "Tally",
    "Workload",
    "chat",
    "drift",
    "drive",
    "histogram",
    "rag",
    "shared_prefix",
    "summarize",
    "zipf_weights",
]
