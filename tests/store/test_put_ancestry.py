"""A put that extends a stored chain costs what its own blocks cost: the ancestry a lookup or an
earlier put verified (the lookup memo) is neither hashed nor read again, and it is trusted only
while no block has been removed since, in this process or any other."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import xxhash

import prefixd.store.put as put_module
from prefixd import Identity, Store
from prefixd.errors import OrphanBlockError

BLOCKS = 64
TOKENS = list(range(1000, 1000 + 4 * (BLOCKS + 2)))  # blocks of 4 tokens


class Counted:
    """Calls of a function, counted and passed through."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.real(*args, **kwargs)


def grow(store: Store, identity: Identity, n: int) -> None:
    """Put blocks 0..n-1 one put at a time, as an engine closes them one by one."""
    for k in range(n):
        store.put(identity, TOKENS[: 4 * (k + 1)], [bytes([k]) * 64], first_block=k)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[Counted, Counted]:
    hashes = Counted(xxhash.xxh3_128_digest)  # every chain hash goes through it
    walks = Counted(put_module.walk_chain)
    monkeypatch.setattr(xxhash, "xxh3_128_digest", hashes)
    monkeypatch.setattr(put_module, "walk_chain", walks)
    return hashes, walks


def test_extending_a_chain_hashes_and_reads_only_the_new_block(
    store: Store, identity: Identity, counted: tuple[Counted, Counted]
) -> None:
    hashes, walks = counted
    grow(store, identity, BLOCKS)
    hashes.calls = walks.calls = 0
    result = store.put(identity, TOKENS[: 4 * (BLOCKS + 1)], [b"x" * 64], first_block=BLOCKS)
    assert result.stored == 1
    assert hashes.calls == 1  # block 64's hash alone, not blocks 0..63 again
    assert walks.calls == 0  # blocks 0..63 are not read again
    assert store.longest_prefix(identity, TOKENS).n_blocks == BLOCKS + 1


def test_a_lookup_verifies_the_ancestry_a_later_put_extends(
    tmp_path: Path, identity: Identity, counted: tuple[Counted, Counted]
) -> None:
    hashes, walks = counted
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        grow(store, identity, BLOCKS)
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:  # a new process's memo: empty
        assert store.longest_prefix(identity, TOKENS[: 4 * BLOCKS]).n_blocks == BLOCKS
        hashes.calls = walks.calls = 0
        store.put(identity, TOKENS[: 4 * (BLOCKS + 1)], [b"x" * 64], first_block=BLOCKS)
        assert (hashes.calls, walks.calls) == (1, 0)


def test_a_removal_since_sends_the_put_back_to_the_walk(
    store: Store, identity: Identity, counted: tuple[Counted, Counted]
) -> None:
    _, walks = counted
    grow(store, identity, BLOCKS)
    victim = store.longest_prefix(identity, TOKENS).hashes[30]
    walks.calls = 0
    assert store.delete([victim]) == BLOCKS - 30
    with pytest.raises(OrphanBlockError, match="block 30 is missing"):
        store.put(identity, TOKENS[: 4 * (BLOCKS + 1)], [b"x" * 64], first_block=BLOCKS)
    assert walks.calls == 1
    assert store.longest_prefix(identity, TOKENS).n_blocks == 30


def test_a_removal_in_another_process_is_seen_by_the_next_put(
    tmp_path: Path, identity: Identity
) -> None:
    path = tmp_path / "s"
    with Store.open(path, map_size=64 << 20) as store:
        grow(store, identity, BLOCKS)
        victim = store.longest_prefix(identity, TOKENS).hashes[10]
        code = (
            "from prefixd import Store;"
            f"s = Store.open({str(path)!r}, create=False);"
            f"print(s.delete([bytes.fromhex({victim.hex()!r})])); s.close()"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stderr
        with pytest.raises(OrphanBlockError, match="block 10 is missing"):
            store.put(identity, TOKENS[: 4 * (BLOCKS + 1)], [b"x" * 64], first_block=BLOCKS)
        assert store.check() == []


def test_a_put_after_another_tokens_put_does_not_borrow_its_ancestry(
    store: Store, identity: Identity
) -> None:
    grow(store, identity, 8)
    other = TOKENS[:16] + [7, 7, 7, 7] + TOKENS[20:36]  # block 4 differs, then the same tokens
    with pytest.raises(OrphanBlockError, match="block 4 is missing"):
        store.put(identity, other, [b"y" * 64], first_block=8)
    store.put(identity, other[:20], [b"z" * 64], first_block=4)
    store.put(identity, other, [b"y" * 64] * 4, first_block=5)
    out = bytearray(64 * 9)
    assert store.load(identity, other, out).n_blocks == 9
    assert bytes(out[64 * 4 : 64 * 5]) == b"z" * 64 and bytes(out[:64]) == bytes([0]) * 64
