"""A request's chain is rebuilt from the end-token positions vLLM's scheduler records: whatever
order they were recorded in, it is the longest run of consecutive chunks from the first, per
group, and never reaches past a gap."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.kv_offload.base import make_offload_key

from prefixd.integrations.vllm.chains import Chains

SPANS = {0: 32, 1: 64}


@given(
    st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(0, 40)), unique=True, max_size=60),
    st.randoms(),
)
def test_the_chain_is_the_longest_run_from_the_first_chunk(
    chunks: list[tuple[int, int]], rng: object
) -> None:
    keys = {(g, i): make_offload_key(bytes([g, i]) * 16, g) for g, i in chunks}
    entries = [(keys[g, i], (i + 1) * SPANS[g]) for g, i in chunks]
    rng.shuffle(entries)  # type: ignore[attr-defined]
    entries.append((make_offload_key(b"x" * 32, 0), 48))  # a boundary key: not a chunk end
    chains = Chains(SPANS).of(dict(entries))
    for group in SPANS:
        run = 0
        while (group, run) in keys:
            run += 1
        chain = chains.get(group)
        got = chain.keys if chain is not None else []
        assert got == [keys[group, i] for i in range(run)]
        if chain is not None:
            assert all(chain.places[k] == i for i, k in enumerate(chain.keys))
