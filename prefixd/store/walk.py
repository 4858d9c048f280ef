"""Following a prefix chain through the blocks table, comparing records in bulk.

Per-block Python work dominates the lookup hot path, so records are fetched in batches (small first,
so a cold miss costs little) and compared against the query with one vectorised comparison per
batch. The walk stops at the first missing or mismatching block, as a block-by-block walk would. It
reads no payload, so it skips record checksums; a mismatching record is decoded in full to tell
damage (quarantine) from a collision (a counted miss)."""

from __future__ import annotations

from dataclasses import dataclass, field

import lmdb
import numpy as np

from prefixd.errors import CorruptRecordError
from prefixd.schema.chain import ROOT_PARENT, BlockChain
from prefixd.schema.records import (
    CREATED_AT,
    IDENTITY_AT,
    PARENT_AT,
    PAYLOAD_SIZE_AT,
    TOKENS_AT,
    BlockRecord,
    record_bytes,
    record_prefix,
)

_FIRST_BATCH = 4
_GROWTH = 8
# Field positions in uint32 words (every record field the walk compares is 4-byte aligned).
_MAGIC = int.from_bytes(record_prefix()[:4], "little")
_VERSION = record_prefix()[4]
_PAYLOAD_SIZE = PAYLOAD_SIZE_AT // 4
_STORED_SIZE = _PAYLOAD_SIZE + 2  # stored_size follows payload_size (both u64)
_CHUNK_BYTES = 2  # chunk_bytes and n_chunks: u32 words 2 and 3 of the header
_N_CHUNKS = 3
_CREATED = CREATED_AT // 4
_IDENTITY = IDENTITY_AT // 4
_PARENT = PARENT_AT // 4
_TOKENS = TOKENS_AT // 4


@dataclass
class Walk:
    hashes: list[bytes] = field(default_factory=list)
    payload_sizes: list[int] = field(default_factory=list)
    corrupt: bytes | None = None
    collided: bool = False
    expired: bool = False  # ended at a block older than its tenant's time to live
    oldest_created_ns: int = 1 << 63  # of the blocks found


def walk_chain(
    txn: lmdb.Transaction,
    blocks_db: lmdb._Database,
    chain: BlockChain,
    limit: int,
    verified: Walk | None = None,
    min_created_ns: int = 0,
) -> Walk:
    """Follow `chain` from block 0 for at most `limit` blocks, extending in place the walk
    `verified` when given (blocks already verified). A block created before `min_created_ns` (past
    its time to live) counts as missing."""
    walk = Walk() if verified is None else verified
    get = txn.cursor(db=blocks_db).get
    size = record_bytes(chain.block_tokens)
    digest = np.frombuffer(chain.identity.digest, dtype="<u4")
    start, batch = len(walk.hashes), _FIRST_BATCH
    known = chain.known_hashes
    while start < limit:
        stop = min(limit, start + batch)
        batch = limit if known >= limit else batch * _GROWTH
        keys = chain.hashes_until(stop)[start:stop]
        values = [get(key, b"") for key in keys]
        lengths = list(map(len, values))
        present = lengths.index(0) if 0 in lengths else len(values)
        del values[present:]
        usable = present
        if lengths.count(size) < present:  # a record of another length ends the usable run
            usable = next(j for j, n in enumerate(lengths) if n != size)
        # block start's parent is the hash the walk holds for block start-1, never the query's:
        # a client's wrong hashes there (after a memo hit) would pass another prefix's block
        parent = walk.hashes[-1] if walk.hashes else ROOT_PARENT
        matched, oldest, expired = _matching_rows(
            values[:usable], size, digest, chain, start, parent, keys, min_created_ns
        )
        walk.hashes.extend(keys[: len(matched)])
        walk.payload_sizes.extend(matched)
        walk.oldest_created_ns = min(walk.oldest_created_ns, oldest)
        if expired:
            walk.expired = True
            return walk
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
    parent: bytes,
    keys: list[bytes],
    min_created_ns: int,
) -> tuple[list[int], int, bool]:
    """Payload sizes of the leading records that match the query and are not expired, the oldest
    creation time among them, and whether an expired record ended the run. Records of one identity
    share one length, so a batch is one uint32 array."""
    n = len(values)
    if not n:
        return [], 1 << 63, False
    rows = np.frombuffer(b"".join(values), dtype="<u4").reshape(n, size // 4)
    span = chain.block_tokens
    parents = np.frombuffer(b"".join([parent, *keys[: n - 1]]), dtype="<u4")
    expected_tokens = chain.tokens[start * span : (start + n) * span].reshape(n, span)
    ok = (rows[:, _TOKENS : _TOKENS + span] == expected_tokens).all(axis=1)
    ok &= (rows[:, _PARENT : _PARENT + 4] == parents.reshape(n, 4)).all(axis=1)
    ok &= (rows[:, _IDENTITY : _IDENTITY + 4] == digest).all(axis=1)
    ok &= (rows[:, 0] == _MAGIC) & (rows[:, 1] & 0xFF == _VERSION)
    ok &= _plausible_sizes(rows)
    created = rows[:, _CREATED : _CREATED + 2].copy().view("<u8").ravel()
    fresh = created >= min_created_ns
    usable = ok & fresh
    good = n if usable.all() else int(np.argmin(usable))
    expired = good < n and bool(ok[good]) and not bool(fresh[good])
    sizes = rows[:good, _PAYLOAD_SIZE : _PAYLOAD_SIZE + 2].copy().view("<u8").ravel()
    oldest = int(created[:good].min()) if good else 1 << 63
    return sizes.tolist(), oldest, expired


def _plausible_sizes(rows: np.ndarray) -> np.ndarray:
    """Whether each record's sizes agree with each other (the checksum is too dear for the walk). A
    record failing this ends the walk and is checked in full, so a damaged size is quarantined
    instead of reported."""
    payload = rows[:, _PAYLOAD_SIZE : _PAYLOAD_SIZE + 2].copy().view("<u8").ravel()
    stored = rows[:, _STORED_SIZE : _STORED_SIZE + 2].copy().view("<u8").ravel()
    chunk = rows[:, _CHUNK_BYTES].astype(np.uint64)
    n_chunks = rows[:, _N_CHUNKS].astype(np.uint64)
    raw = (rows[:, 1] >> 8) & 0xFF == 0
    filled = np.where(
        n_chunks == 0,
        payload == 0,
        (payload <= n_chunks * chunk) & (payload > (n_chunks - 1) * chunk),
    )
    plausible: np.ndarray = filled & (~raw | (payload == stored))  # numpy types this as Any
    return plausible


def _classify(walk: Walk, key: bytes, value: bytes | memoryview) -> None:
    try:
        BlockRecord.decode(value)
    except CorruptRecordError:
        walk.corrupt = key
    else:
        walk.collided = True
