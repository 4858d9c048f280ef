"""Following a prefix chain through the blocks table, comparing records in bulk.

The walk is the lookup hot path: a 131072-token prompt is 256 blocks of 512 tokens. Per-block Python
work dominates, so records are fetched in batches (one `getmulti` per batch, batches growing 4x so a
cold miss costs little) and each record's identity digest, parent hash and token ids are compared
against the query with one vectorised comparison per batch. The walk stops at the first missing or
mismatching block, exactly as a one-block-at-a-time walk would.

The walk reads no payload and hands out no bytes, so it does not verify record checksums; a
mismatching record is decoded with its checksum to tell damage (quarantine) from a hash collision
(a counted miss), and `load` verifies every record and payload it returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lmdb
import numpy as np

from prefixd.schema.chain import HASH_BYTES, BlockChain
from prefixd.schema.records import (
    IDENTITY_AT,
    PARENT_AT,
    PAYLOAD_SIZE_AT,
    TOKENS_AT,
    BlockRecord,
    CorruptRecordError,
    record_bytes,
    record_prefix,
)

_FIRST_BATCH = 4
_PREFIX = np.frombuffer(record_prefix(), dtype=np.uint8)


@dataclass
class Walk:
    """Blocks found from block 0, and why the walk ended early if it did."""

    hashes: list[bytes] = field(default_factory=list)
    payload_sizes: list[int] = field(default_factory=list)
    corrupt: bytes | None = None
    collided: bool = False


def walk_chain(
    txn: lmdb.Transaction, blocks_db: lmdb._Database, chain: BlockChain, limit: int
) -> Walk:
    """Follow `chain` from block 0 for at most `limit` blocks."""
    walk = Walk()
    cursor = txn.cursor(db=blocks_db)
    size = record_bytes(chain.block_tokens)
    span = chain.block_tokens * 4
    digest = np.frombuffer(chain.identity.digest, dtype=np.uint8)
    tokens = np.frombuffer(chain.tokens.data, dtype=np.uint8)
    start, batch = 0, _FIRST_BATCH
    while start < limit:
        stop = min(limit, start + batch)
        batch *= 4
        keys = chain.hashes_until(stop)[start:stop]
        pairs = cursor.getmulti(keys)
        present = len(pairs)
        if present < len(keys):  # getmulti skips absent keys: find the first gap
            present = next(
                (j for j, (key, _) in enumerate(pairs) if bytes(key) != keys[j]), present
            )
        values = [value for _, value in pairs[:present]]
        usable = next((j for j, v in enumerate(values) if len(v) != size), present)
        matched = _matching_rows(values[:usable], size, digest, chain, start, keys, tokens, span)
        walk.hashes.extend(keys[: len(matched)])
        walk.payload_sizes.extend(matched)
        if len(matched) < present:
            _classify(walk, keys[len(matched)], values[len(matched)])
            return walk
        if present < len(keys):
            return walk
        start = stop
    return walk


def _matching_rows(
    values: list[bytes | memoryview],
    size: int,
    digest: np.ndarray,
    chain: BlockChain,
    start: int,
    keys: list[bytes],
    tokens: np.ndarray,
    span: int,
) -> list[int]:
    """Payload sizes of the leading records that match the query exactly."""
    n = len(values)
    if not n:
        return []
    rows = np.frombuffer(b"".join(values), dtype=np.uint8).reshape(n, size)
    parents = np.frombuffer(
        b"".join([chain.parent_of(start), *keys[: n - 1]]), dtype=np.uint8
    ).reshape(n, HASH_BYTES)
    expected_tokens = tokens[start * span : (start + n) * span].reshape(n, span)
    ok = (
        (rows[:, : len(_PREFIX)] == _PREFIX).all(axis=1)
        & (rows[:, IDENTITY_AT : IDENTITY_AT + HASH_BYTES] == digest).all(axis=1)
        & (rows[:, PARENT_AT : PARENT_AT + HASH_BYTES] == parents).all(axis=1)
        & (rows[:, TOKENS_AT : TOKENS_AT + span] == expected_tokens).all(axis=1)
    )
    good = n if ok.all() else int(np.argmin(ok))
    sizes = np.ascontiguousarray(rows[:good, PAYLOAD_SIZE_AT : PAYLOAD_SIZE_AT + 8])
    return sizes.view("<u8").ravel().tolist()


def _classify(walk: Walk, key: bytes, value: bytes | memoryview) -> None:
    """A record that did not match: damaged (quarantine it) or a genuine collision (count it)."""
    try:
        BlockRecord.decode(value)
    except CorruptRecordError:
        walk.corrupt = key
    else:
        walk.collided = True
