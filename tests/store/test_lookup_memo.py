"""The lookup memo (prefixd.store.lookup_memo): repeated lookups skip the walk, and nothing
stale is ever served."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.errors import OrphanBlockError
from prefixd.schema.chain import chain_hashes, packed_hashes
from prefixd.store.purge import PurgeSelector

TOKENS = list(range(100, 140))  # ten closed blocks of 4


def payloads(n: int, start: int = 0) -> list[bytes]:
    return [bytes([start + i]) * 64 for i in range(n)]


def test_repeated_lookups_hit_and_agree(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(10))
    first = store.longest_prefix(identity, TOKENS)
    hits = store._reader.memo.hits
    again = store.longest_prefix(identity, TOKENS)
    assert store._reader.memo.hits == hits + 1
    assert again == first
    out = bytearray(1000)
    loaded = store.load(identity, TOKENS, out)
    assert loaded.n_blocks == 10 and bytes(out[64 * 9 : 64 * 10]) == bytes([9]) * 64


def test_a_removal_invalidates_what_was_verified(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(10))
    match = store.longest_prefix(identity, TOKENS)
    store.delete([match.hashes[6]])
    assert store.longest_prefix(identity, TOKENS).n_blocks == 6
    assert store.load(identity, TOKENS, bytearray(1000)).n_blocks == 6


def test_blocks_added_later_extend_a_verified_prefix(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(4))
    assert store.longest_prefix(identity, TOKENS).n_blocks == 4
    store.put(identity, TOKENS, payloads(3, start=4), first_block=4)
    assert store.longest_prefix(identity, TOKENS).n_blocks == 7


def test_other_tokens_or_identity_never_hit(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(10))
    store.longest_prefix(identity, TOKENS)
    good = packed_hashes(identity, TOKENS)
    changed = TOKENS[:20] + [1] * 20  # same first five blocks, then other tokens
    assert store.longest_prefix(identity, changed, hashes=good).n_blocks == 5
    other = Identity(**{**identity.to_dict(), "tenant": "b"})
    assert store.longest_prefix(other, TOKENS, hashes=good).n_blocks == 0
    assert store.load(other, TOKENS, bytearray(1000), hashes=good).n_blocks == 0


def test_max_blocks_bounds_a_cached_answer(store: Store, identity: Identity) -> None:
    store.put(identity, TOKENS, payloads(10))
    store.longest_prefix(identity, TOKENS)
    assert store.load(identity, TOKENS, bytearray(1000), max_blocks=3).n_blocks == 3


def test_removal_by_another_process_is_seen(tmp_path: Path, identity: Identity) -> None:
    path = tmp_path / "s"
    with Store.open(path) as store:
        store.put(identity, TOKENS, payloads(10))
        victim = store.longest_prefix(identity, TOKENS).hashes[2]
        assert store.longest_prefix(identity, TOKENS).n_blocks == 10  # now remembered
        code = (
            "import sys; from prefixd import Store;"
            f"s = Store.open({str(path)!r}, create=False);"
            f"print(s.delete([bytes.fromhex({victim.hex()!r})])); s.close()"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "8"
        assert store.longest_prefix(identity, TOKENS).n_blocks == 2


def test_cache_is_bounded(tmp_path: Path, identity: Identity) -> None:
    with Store.open(tmp_path / "s", verified_cache_bytes=200) as store:
        rng = np.random.default_rng(0)
        for _ in range(20):
            tokens = rng.integers(0, 1000, 8).tolist()
            store.put(identity, tokens, payloads(2))
            store.longest_prefix(identity, tokens)
        assert store._reader.memo._bytes <= 200


def test_cached_prefix_answers_only_whole_unchanged_prompts(
    store: Store, identity: Identity
) -> None:
    store.put(identity, TOKENS[:20], payloads(5))
    assert store.cached_prefix(identity, TOKENS) is None  # nothing verified of these 10 blocks
    store.put(identity, TOKENS, payloads(5), first_block=5)
    put = store.cached_prefix(identity, TOKENS)  # a put remembers the chain it wrote
    walked = store.longest_prefix(identity, TOKENS)
    assert put == walked
    assert store.cached_prefix(identity, TOKENS) == walked
    assert store.cached_prefix(identity, TOKENS + [1, 2]) == walked  # an open tail is fine
    assert store.cached_prefix(identity, TOKENS[:-4]) is None  # not the whole remembered prefix
    assert store.cached_prefix(identity, TOKENS[:-1] + [7]) is None  # one token differs
    other = Identity(**{**identity.to_dict(), "tenant": "b"})
    assert store.cached_prefix(other, TOKENS) is None
    store.delete([walked.hashes[9]])
    assert store.cached_prefix(identity, TOKENS) is None  # a removal since: walk again


def test_forged_hashes_never_serve_or_record_another_chains_block(
    store: Store, identity: Identity
) -> None:
    prompt = TOKENS[:24]  # blocks T0..T5
    other = [7] * 16 + prompt[16:20]  # another prefix, then the same tokens as T4
    store.put(identity, prompt[:16], payloads(4))
    store.put(identity, other, payloads(5, start=10))
    mine, theirs = chain_hashes(identity, prompt), chain_hashes(identity, other)
    store.longest_prefix(identity, prompt[:16])  # remembered under block 3's hash
    forged = b"".join([*mine[:3], theirs[3], theirs[4], mine[3]])
    found = store.longest_prefix(identity, prompt, hashes=forged).hashes
    assert found == tuple(mine[: len(found)])  # a wrong hash is a miss, never their block 4
    # and nothing of the kind is remembered for honest callers of the same prompt
    assert store.longest_prefix(identity, prompt[:20]).n_blocks == 4
    assert store.load(identity, prompt[:20], bytearray(1000)).n_blocks == 4
    with pytest.raises(OrphanBlockError):  # block 4 of this prompt was never stored
        store.put(identity, prompt, payloads(1, start=5), first_block=5)


def test_a_lookup_a_purge_overtook_keeps_none_of_the_purged_tokens(
    store: Store, identity: Identity, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup walked the tenant's prompt before its purge and remembers it after: the purged
    tenant's token ids must not stay in the daemon's memory."""
    tokens = np.arange(7000, 7016, dtype=np.uint32)
    store.put(identity, tokens, payloads(4))
    memo = store._ctx.memo
    walked, purged = threading.Event(), threading.Event()
    remember = memo.remember

    def late(*args: object, **kwargs: object) -> None:
        walked.set()
        assert purged.wait(60)
        remember(*args, **kwargs)  # type: ignore[arg-type]

    forget = memo.forget_identities

    def forgotten(*args: object) -> None:  # the purge committed, and is clearing the files
        forget(*args)  # type: ignore[arg-type]
        purged.set()

    monkeypatch.setattr(memo, "find", lambda *args, **kwargs: None)  # the put's entry aside
    monkeypatch.setattr(memo, "remember", late)
    monkeypatch.setattr(memo, "forget_identities", forgotten)
    with ThreadPoolExecutor(1) as pool:
        looking = pool.submit(store.longest_prefix, identity, tokens)
        assert walked.wait(60)
        assert store.purge(PurgeSelector(tenant=identity.tenant)).blocks == 4
        looking.result(60)
    assert not [e for e in memo._entries.values() if e.identity == identity.digest]
