"""Hybrid identities through the daemon: joint puts, lookups and loads, restarts, bad input."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from prefixd.client import AsyncClient, Client
from prefixd.errors import PrefixdError
from prefixd.schema.state import StateGroup

from .conftest import Daemon, make_identity, payload

SPEC = (
    StateGroup.paged("mla", page_blocks=2),
    StateGroup.checkpoint("kda"),
    StateGroup.checkpoint("swa", policy="none", replay_tokens=6),
)
HYBRID = make_identity(state=SPEC)
BT = HYBRID.block_tokens


def tokens(n: int, seed: int = 1) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) * 13 + seed * 1_000_003 + 600_000_000).astype(np.uint32)


def test_joint_put_lookup_load_survive_a_restart(daemon: Daemon) -> None:
    prompt = tokens(8 * BT + 3)  # 8 closed blocks and an open tail
    pages = [payload(1, i, 300 + i) for i in range(4)]
    snaps = {2 * BT: payload(2, 2, 500), 5 * BT: payload(2, 5, 520)}
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        stored = client.put_state(
            HYBRID,
            prompt,
            upto_tokens=8 * BT,
            paged={"mla": pages},
            checkpoints={"kda": snaps},
        )
        assert (stored.stored, stored.existed, stored.parts) == (8, 0, 6)
        [hit, miss] = client.lookup_state(HYBRID, [prompt, tokens(3 * BT, seed=2)])
        assert (hit.reusable_tokens, hit.paged_tokens, hit.matched_tokens) == (20, 32, 32)
        assert hit.replay_from == 20 - 6 - 2  # 'swa' stores nothing: back to a block boundary
        assert [(p.group, p.first_token, p.tokens) for p in hit.parts] == [
            ("mla", 0, 8),
            ("mla", 8, 8),
            ("mla", 16, 8),
            ("kda", 20, 0),
        ]
        assert (miss.reusable_tokens, miss.parts) == (0, ())
    daemon.restart()
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        loaded = client.load_state(HYBRID, prompt)
        assert loaded.reusable_tokens == 20
        groups = loaded.by_group()
        assert [bytes(p.view) for p in groups["mla"]] == pages[:3]
        assert [bytes(p.view) for p in groups["kda"]] == [snaps[20]]
        # the plain operations refuse a hybrid identity: they cannot say what is jointly there
        with pytest.raises(PrefixdError, match="lookup_state"):
            client.lookup(HYBRID, [prompt])
        with pytest.raises(PrefixdError, match="load_state"):
            client.load(HYBRID, prompt)


def test_open_state_and_bad_spans_are_refused(daemon: Daemon) -> None:
    prompt = tokens(4 * BT)
    with Client(daemon.socket, region_bytes=1 << 16) as client:
        with pytest.raises(PrefixdError, match="not closed") as info:
            client.put_state(HYBRID, prompt, upto_tokens=3 * BT, paged={"mla": [b"a", b"b"]})
        assert info.value.code == "open_tail"
        with pytest.raises(PrefixdError, match="past the last closed block"):
            client.put_state(
                HYBRID, prompt, paged={"mla": [b"a", b"b"]}, checkpoints={"kda": {6: b"s"}}
            )
        with pytest.raises(PrefixdError, match="policy 'none'"):
            client.put_state(
                HYBRID, prompt, paged={"mla": [b"a", b"b"]}, checkpoints={"swa": {8: b"s"}}
            )
        bad_messages = [
            {"paged": {"mla": "nope"}},
            {"paged": {"mla": [[0, 0]]}},
            {"paged": [1, 2]},
            {"checkpoints": {"kda": [[4]]}},
            {"checkpoints": {"kda": [["4", [0, 0, 1]]]}},
            {"checkpoints": {"kda": [[4, [99, 0, 1]]]}},
            {"upto_tokens": "all"},
            {"paged": {"mla": [[1, 0, 1 << 16]] * 2}},  # its region named twice over
        ]
        base = {"op": "put_state", "identity": HYBRID.to_dict(), "tokens": prompt.tobytes()}
        for extra in bad_messages:
            with pytest.raises(PrefixdError) as info:
                client.call({**base, **extra})
            assert info.value.code in ("bad_request", "bad_region"), extra
        assert client.health()["status"] == "ok"
        assert client.lookup_state(HYBRID, [prompt])[0].matched_tokens == 0


def test_the_async_client_speaks_state_groups(daemon: Daemon) -> None:
    prompt = tokens(4 * BT, seed=3)

    async def run() -> None:
        async with await AsyncClient.connect(daemon.socket, region_bytes=1 << 16) as client:
            stored = await client.put_state(
                HYBRID,
                prompt,
                paged={"mla": [b"page0", b"page1"]},
                checkpoints={"kda": {4 * BT: b"state"}},
            )
            assert stored.parts == 3
            [hit] = await client.lookup_state(HYBRID, [prompt])
            assert hit.reusable_tokens == 4 * BT
            loaded = await client.load_state(HYBRID, prompt)
            assert [bytes(p.view) for p in loaded.parts] == [b"page0", b"page1", b"state"]

    asyncio.run(run())
