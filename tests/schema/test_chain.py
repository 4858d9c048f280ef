"""The prefix chain: determinism, parent dependence, open tails, and property tests."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixd import BlockChain, Identity, chain_hashes
from prefixd.errors import TokenError
from prefixd.schema.chain import ROOT_PARENT, block_hash
from prefixd.schema.tokens import as_token_array

IDENT = Identity(
    model="llama-3-8b",
    weights="sha256:0123",
    tokenizer="tok-v2",
    template="chat-v3",
    rope="rope-theta-500000",
    kv_layout="bf16/paged-16/tp1-rank0",
    block_tokens=4,
    tenant="acme",
)
GOLDEN_CHAIN = ["3d9b993df6fd494a43ad13193cf00b73", "ec4a0c07e704eebb9545340389405df3"]

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40)


def test_golden_chain() -> None:
    assert [h.hex() for h in chain_hashes(IDENT, list(range(10)))] == GOLDEN_CHAIN


def test_chain_is_the_same_in_every_process() -> None:
    code = (
        "from prefixd import Identity, chain_hashes;"
        f"ident = Identity(**{IDENT.to_dict()!r});"
        "print(','.join(h.hex() for h in chain_hashes(ident, list(range(10)))))"
    )
    outputs = set()
    for seed in ("0", "1", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stderr
        outputs.add(out.stdout.strip())
    assert outputs == {",".join(GOLDEN_CHAIN)}


def test_open_tail_has_no_hash() -> None:
    assert len(chain_hashes(IDENT, list(range(7)))) == 1
    assert chain_hashes(IDENT, [1, 2, 3]) == []


def test_first_block_uses_the_root_parent() -> None:
    tokens = as_token_array([5, 6, 7, 8])
    expected = block_hash(IDENT.digest, ROOT_PARENT, tokens.tobytes())
    assert chain_hashes(IDENT, [5, 6, 7, 8]) == [expected]


@given(token_lists, token_lists)
def test_a_block_hash_depends_on_the_whole_prefix(a: list[int], b: list[int]) -> None:
    """Equal hashes at block i iff the token prefixes up to block i are equal."""
    ha, hb = chain_hashes(IDENT, a), chain_hashes(IDENT, b)
    for i in range(min(len(ha), len(hb))):
        same_prefix = a[: (i + 1) * 4] == b[: (i + 1) * 4]
        assert (ha[i] == hb[i]) == same_prefix


@given(token_lists)
def test_input_forms_agree(tokens: list[int]) -> None:
    as_list = chain_hashes(IDENT, tokens)
    as_array = chain_hashes(IDENT, np.array(tokens, dtype=np.uint64))
    as_bytes = chain_hashes(IDENT, np.array(tokens, dtype="<u4").tobytes())
    assert as_list == as_array == as_bytes


@given(token_lists, st.integers(0, 9))
def test_lazy_hashing_matches_eager(tokens: list[int], index: int) -> None:
    chain = BlockChain(IDENT, tokens)
    eager = chain_hashes(IDENT, tokens)
    if index < chain.n_blocks:
        assert chain.hash(index) == eager[index]
        assert chain.parent_of(index) == (eager[index - 1] if index else ROOT_PARENT)
    assert list(chain) == eager


def test_identity_changes_every_hash() -> None:
    other = Identity(**{**IDENT.to_dict(), "tenant": "globex"})
    tokens = list(range(12))
    assert set(chain_hashes(IDENT, tokens)).isdisjoint(chain_hashes(other, tokens))


@pytest.mark.parametrize(
    "bad",
    [
        [-1],
        [2**32],
        [1.5],
        ["7"],
        [True],
        "1234",
        np.array([[1, 2]]),
        np.array([0.5]),
        b"\x00\x01\x02",
    ],
)
def test_bad_token_ids_are_refused(bad: object) -> None:
    with pytest.raises(TokenError):
        as_token_array(bad)  # type: ignore[arg-type]


def test_int64_arrays_are_range_checked_not_wrapped() -> None:
    with pytest.raises(TokenError):
        as_token_array(np.array([2**32 + 5], dtype=np.int64))
    with pytest.raises(TokenError):
        as_token_array(np.array([-3], dtype=np.int32))
