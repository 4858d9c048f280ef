"""Engine-keyed blocks: an engine's own block keys in the place of token ids, with every guarantee
the token-keyed mode gives (identity namespacing, the key compared on every hit, verified
payloads, quarantine, eviction by value, purge, check) from the same store machinery."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from prefixd import Identity, Store
from prefixd.clock import ManualClock
from prefixd.errors import IdentityError, OrphanBlockError, TokenError
from prefixd.schema.chain import chain_hashes
from prefixd.schema.keys import pack_keys, unpack_keys
from prefixd.schema.records import BlockRecord
from prefixd.store.purge import PurgeSelector

from .test_faults import IDENT, corrupt_payload

ENGINE = replace(IDENT, block_tokens=32, key_bytes=36)


def vllm_keys(seed: int, n: int, group: int = 0) -> list[bytes]:
    """Keys shaped as vLLM's: a 32-byte chained block hash and a 4-byte big-endian group index."""
    keys, parent = [], seed.to_bytes(8, "big")
    for i in range(n):
        parent = hashlib.sha256(parent + i.to_bytes(4, "big")).digest()
        keys.append(parent + group.to_bytes(4, "big"))
    return keys


def payloads(n: int, size: int = 3000, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def load_all(store: Store, identity: Identity, keys: list[bytes], size: int = 3000) -> list[bytes]:
    out = bytearray(size * len(keys))
    loaded = store.load(identity, pack_keys(identity, keys), out)
    return [bytes(out[o : o + s]) for o, s in zip(loaded.offsets, loaded.sizes)]


def test_keys_shorter_than_128_bits_or_odd_are_refused() -> None:
    for bad in (12, 8, 0, 18, 1024, True, 36.0):
        with pytest.raises(IdentityError, match="key_bytes"):
            replace(ENGINE, key_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(TokenError, match="not 36"):
        pack_keys(ENGINE, [bytes(36), bytes(16)])
    with pytest.raises(TokenError, match="engine-keyed"):
        pack_keys(replace(ENGINE, key_bytes=None), [bytes(36)])


def test_the_key_width_is_part_of_the_identity() -> None:
    token_keyed = replace(ENGINE, key_bytes=None)
    assert ENGINE.digest != token_keyed.digest != replace(ENGINE, key_bytes=40).digest
    assert Identity.decode(ENGINE.encode()) == ENGINE
    assert Identity.decode(token_keyed.encode()) == token_keyed
    assert ENGINE.block_words == 9 and token_keyed.block_words == 32
    assert unpack_keys(ENGINE, pack_keys(ENGINE, vllm_keys(1, 3))) == vllm_keys(1, 3)


def test_put_then_load_by_engine_keys(store: Store) -> None:
    keys, data = vllm_keys(1, 5), payloads(5)
    result = store.put(ENGINE, pack_keys(ENGINE, keys), data)
    assert (result.stored, result.existed) == (5, 0)
    match = store.longest_prefix(ENGINE, pack_keys(ENGINE, keys))
    assert (match.n_blocks, match.n_tokens) == (5, 5 * 32)  # tokens the keys stand for
    assert load_all(store, ENGINE, keys) == data
    # the stored key is what the record holds: compared on every hit
    exported = store.export_block(result.hashes[1])
    assert exported is not None
    record = BlockRecord.decode(exported.record)
    assert (record.tokens, record.parent) == (keys[1], result.hashes[0])


def test_a_key_is_found_only_under_its_own_identity(store: Store) -> None:
    keys = vllm_keys(1, 3)
    store.put(ENGINE, pack_keys(ENGINE, keys), payloads(3))
    for other in (
        replace(ENGINE, kv_layout="fp8"),
        replace(ENGINE, weights="w2"),
        replace(ENGINE, tenant="b"),
        replace(ENGINE, block_tokens=16),
    ):
        assert store.longest_prefix(other, pack_keys(other, keys)).n_blocks == 0


def test_a_hit_never_reaches_past_a_missing_block(store: Store) -> None:
    keys = vllm_keys(1, 6)
    store.put(ENGINE, pack_keys(ENGINE, keys[:3]), payloads(3))
    # a later key stored for another prefix is not a hit after a prefix that lacks its parents
    with pytest.raises(OrphanBlockError):
        store.put(ENGINE, pack_keys(ENGINE, keys), payloads(2), first_block=4)
    query = pack_keys(ENGINE, keys[:3] + [bytes(36)] + keys[4:])
    assert store.longest_prefix(ENGINE, query).n_blocks == 3
    # the same keys in another order are another chain: nothing found past the first
    swapped = pack_keys(ENGINE, [keys[0], keys[2], keys[1]])
    assert store.longest_prefix(ENGINE, swapped).n_blocks == 1


def test_supplied_hashes_of_other_keys_are_a_miss(store: Store) -> None:
    keys, others = vllm_keys(1, 3), vllm_keys(2, 3)
    store.put(ENGINE, pack_keys(ENGINE, keys), payloads(3))
    hashes = b"".join(chain_hashes(ENGINE, pack_keys(ENGINE, keys)))
    # the records those hashes name hold other keys: compared, so a miss
    assert store.longest_prefix(ENGINE, pack_keys(ENGINE, others), hashes=hashes).n_blocks == 0
    assert store.longest_prefix(ENGINE, pack_keys(ENGINE, keys), hashes=hashes).n_blocks == 3


@pytest.mark.damages_store
def test_a_damaged_payload_is_refused_quarantined_and_a_miss_from_there(tmp_path: Path) -> None:
    keys, data = vllm_keys(1, 4), payloads(4)
    with Store.open(tmp_path / "s", map_size=64 << 20, compression="none") as store:
        store.put(ENGINE, pack_keys(ENGINE, keys), data)
    corrupt_payload(tmp_path / "s", data[2])
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        assert load_all(store, ENGINE, keys) == data[:2]  # verified bytes only, up to the damage
        assert store.longest_prefix(ENGINE, pack_keys(ENGINE, keys)).n_blocks == 2
        stats = store.stats()
        assert (stats.quarantined, stats.blocks) == (1, 2)  # it went, with the block below it
        assert store.check() == []


def test_eviction_weighs_the_tokens_a_key_stands_for(tmp_path: Path) -> None:
    tokens = replace(ENGINE, key_bytes=None, block_tokens=16)
    with Store.open(tmp_path / "s", map_size=64 << 20) as store:
        store.put(tokens, list(range(16)), [bytes(4096)])
        engine = store.put(ENGINE, pack_keys(ENGINE, vllm_keys(1, 1)), [bytes(4096)])
        # same bytes, same reads: the engine block saves 32 tokens of prefill, the other 16
        store.evict(target_bytes=4096)
        assert store.block_info(engine.hashes[0]) is not None
        assert store.longest_prefix(tokens, list(range(16))).n_blocks == 0


def test_purge_retire_and_check_cover_engine_keyed_blocks(store: Store) -> None:
    store.put(ENGINE, pack_keys(ENGINE, vllm_keys(1, 3)), payloads(3))
    store.put(replace(ENGINE, weights="w2"), pack_keys(ENGINE, vllm_keys(1, 3)), payloads(3))
    store.put(replace(ENGINE, tenant="b"), pack_keys(ENGINE, vllm_keys(1, 2)), payloads(2))
    assert store.check() == []
    retired = store.purge(PurgeSelector(model="m", keep={"weights": "w2"}))
    assert (retired.identities, retired.blocks) == (2, 5)  # weights w, of both tenants
    assert store.longest_prefix(ENGINE, pack_keys(ENGINE, vllm_keys(1, 3))).n_blocks == 0
    assert store.purge(PurgeSelector(tenant="a")).blocks == 3
    assert store.stats().blocks == 0


def test_ttls_and_quotas_hold_engine_keyed_tenants(tmp_path: Path) -> None:
    clock = ManualClock()
    keys = pack_keys(ENGINE, vllm_keys(1, 4))
    with Store.open(
        tmp_path / "s",
        map_size=64 << 20,
        tenant_ttls=("a=1s",),
        tenant_quotas=("b=8KiB",),
        clock=clock,
    ) as store:
        store.put(ENGINE, keys, payloads(4, 1000))
        clock.advance(1.5)
        assert store.longest_prefix(ENGINE, keys).n_blocks == 0  # expired: unreachable at once
        assert store.reclaim_expired() == 4
        quota = replace(ENGINE, tenant="b")
        store.put(quota, keys, payloads(4, 4000))  # 16 kB into a tenant of 8 KiB
        assert 0 < store.tenant_bytes("b") <= 8 << 10
        assert 0 < store.longest_prefix(quota, keys).n_blocks < 4  # the prefix shrank from its end


def test_warm_up_names_the_hottest_engine_keyed_prefixes(store: Store) -> None:
    hot, cold = vllm_keys(1, 3), vllm_keys(2, 2)
    store.put(ENGINE, pack_keys(ENGINE, hot), payloads(3))
    store.put(ENGINE, pack_keys(ENGINE, cold), payloads(2))
    for _ in range(5):
        store.longest_prefix(ENGINE, pack_keys(ENGINE, hot))
    first = store.hottest(1 << 20, tenant="a")[0]
    assert first.identity == ENGINE
    assert unpack_keys(ENGINE, first.tokens) == hot  # the keys, in prefix order, to load again
    assert store.hottest(3 * 3000, tenant="a")[0].tokens == pack_keys(ENGINE, hot)
