"""Work on the event loop is bounded: a lookup is answered from memory on the loop only when its
prompts are short; a long one goes to a worker like every other request, so no client can hold
the loop with a prompt of millions of token ids."""

from __future__ import annotations

from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from prefixd import Store
from prefixd.daemon.blocks import LOOP_TOKEN_BYTES, lookup_now
from prefixd.daemon.context import Answered, Request
from prefixd.daemon.metrics import Metrics
from prefixd.daemon.operations import Operations
from prefixd.daemon.peer import Peer
from prefixd.daemon.services import Services
from prefixd.wire.messages import Lookup, Prompt, WireIdentity

from .conftest import IDENTITY


def services(store: Store, pool: Executor) -> Services:
    metrics = Metrics(store, prefill_tokens_per_s=1e4)
    return Services(
        store=store, pool=pool, metrics=metrics, max_frame_bytes=64 << 20, max_region_bytes=1 << 30
    )


def test_only_short_lookups_are_answered_on_the_loop(tmp_path: Path) -> None:
    bt = IDENTITY.block_tokens
    short = np.arange(64 * bt, dtype=np.uint32)
    long = np.arange(LOOP_TOKEN_BYTES // 4 + bt, dtype=np.uint32) // bt * bt + 1
    with Store.open(tmp_path / "s", map_size=256 << 20) as store, ThreadPoolExecutor(1) as pool:
        for prompt in (short, long):
            n = len(prompt) // bt
            store.put(IDENTITY, prompt, [b"x"] * n)
            store.longest_prefix(IDENTITY, prompt)  # now remembered: memory could answer it
        ops = Operations(services(store, pool))
        context = ops.context(Peer(0, max_inflight=64))

        def from_memory(prompt: np.ndarray) -> bool:
            message = Lookup(
                id=1, identity=WireIdentity.of(IDENTITY), prompts=[Prompt(tokens=prompt.tobytes())]
            )
            return isinstance(lookup_now(context, Request(1, message)), Answered)

        assert from_memory(short)
        assert not from_memory(long)  # a worker answers it


def test_a_lookup_memory_answers_in_part_is_counted_once(tmp_path: Path) -> None:
    """Memory answers a request whole or not at all: a prompt it knew, asked beside one it did
    not, is counted as one lookup (by the worker that answers the request), not two."""
    bt = IDENTITY.block_tokens
    known, unknown = np.arange(4 * bt, dtype=np.uint32), np.arange(4 * bt, dtype=np.uint32) + 7
    with Store.open(tmp_path / "s", map_size=64 << 20) as store, ThreadPoolExecutor(1) as pool:
        store.put(IDENTITY, known, [b"x"] * 4)
        store.longest_prefix(IDENTITY, known)  # remembered
        ops = Operations(services(store, pool))
        context = ops.context(Peer(0, max_inflight=64))
        message = Lookup(
            id=1,
            identity=WireIdentity.of(IDENTITY),
            prompts=[Prompt(tokens=known.tobytes()), Prompt(tokens=unknown.tobytes())],
        )
        before = store.stats().lookups
        assert not isinstance(lookup_now(context, Request(1, message)), Answered)
        assert store.stats().lookups == before  # nothing answered, nothing counted
