"""Removing a block and everything below it: the one way blocks leave the store, so no stored block
is ever left without its parent. Everything of the block goes in the caller's transaction, which
also bumps the removal epoch the lookup memo checks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

import lmdb

from prefixd.store import counters
from prefixd.store.tables import Tables, children_key, decoded, decoded_part, prefixed

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

V = TypeVar("V", bound=bytes | memoryview)


def remove_subtree(
    ctx: StoreContext,
    txn: lmdb.Transaction,
    root: bytes,
    root_parent_key: bytes | None = None,
    root_identity: bytes | None = None,
    *,
    reason: str,
) -> int:
    """Delete `root` and its descendants, count them per tenant under `reason`, and return how many
    went. `root_parent_key` and `root_identity` stand in for a root record too damaged to say them.
    """
    t = ctx.tables
    removed = payload_bytes = stored_bytes = parts_removed = 0
    by_identity: Counter[bytes] = Counter()
    blocks_of: Counter[bytes] = Counter()
    # each block with the identity it is charged to: a child shares its parent's, so a record too
    # damaged to say its own is still counted against it
    stack = [(root, root_identity)]
    journal = ctx.journals.current()
    children = txn.cursor(db=t.children)
    while stack:
        h, identity = stack.pop()
        raw = txn.get(h, db=t.blocks)
        if raw is None:
            continue
        # decoded before any write: `raw` may be a view of LMDB's page (a buffers transaction)
        record = decoded(raw)
        if record is not None:
            identity = record.identity
        if journal is not None:
            journal.removed(txn, h, record, reason, identity)
        if children.set_key(h):
            stack.extend((bytes(child), identity) for child in children.iternext_dup())
            txn.delete(h, db=t.children)
        part_payload, n_parts = _delete_parts(txn, t, h)
        freed = _delete_chunks(txn, t, h)
        payload_bytes += part_payload
        parts_removed += n_parts
        txn.delete(h, db=t.blocks)
        txn.delete(h, db=t.access)
        if record is not None:
            txn.delete(children_key(record), h, db=t.children)
            payload_bytes += record.payload_size
        else:
            if h == root and root_parent_key is not None:
                txn.delete(root_parent_key, h, db=t.children)
            payload_bytes += freed
        if identity is not None:
            by_identity[identity] += freed
            blocks_of[identity] += 1
        stored_bytes += freed
        removed += 1
    counters.add(txn, t.counters, counters.REMOVALS, 1 if removed else 0)
    counters.add(txn, t.counters, counters.BLOCKS, -removed)
    counters.add(txn, t.counters, counters.PARTS, -parts_removed)
    counters.add(txn, t.counters, counters.PAYLOAD_BYTES, -payload_bytes)
    counters.add(txn, t.counters, counters.STORED_BYTES, -stored_bytes)
    for digest, freed_bytes in by_identity.items():
        counters.add(txn, t.counters, counters.identity_stored(digest), -freed_bytes)
    for digest, blocks in blocks_of.items():
        counters.add(txn, t.counters, counters.identity_blocks(digest), -blocks)
        ctx.tallies.removed(ctx.tenants.tenant_of(txn, digest) or "", reason, blocks)
    return removed


def delete(ctx: StoreContext, hashes: Iterable[bytes]) -> int:
    removed = 0
    with ctx.writing() as txn:
        for h in hashes:
            removed += remove_subtree(ctx, txn, bytes(h), reason="deleted")
    return removed


def _chunk_bytes(txn: lmdb.Transaction, t: Tables, prefix: bytes) -> int:
    return sum(len(value) for _, value in prefixed(txn.cursor(db=t.chunks), prefix))


def _delete_chunks(txn: lmdb.Transaction, t: Tables, h: bytes) -> int:
    """Delete the chunks under `h` (a block's, and its parts', which share the prefix)."""
    return sum(len(value) for _, value in _deleted(txn.cursor(db=t.chunks), h))


def _delete_parts(txn: lmdb.Transaction, t: Tables, h: bytes) -> tuple[int, int]:
    """Delete the parts hung on `h`; return their payload bytes and how many there were."""
    if t.parts is None:
        return 0, 0
    payload = removed = 0
    for key, raw in _deleted(txn.cursor(db=t.parts), h):
        part = decoded_part(raw)  # None: its size is unknown, so count what its chunks hold
        payload += _chunk_bytes(txn, t, key) if part is None else part.payload_size
        removed += 1
    return payload, removed


def _deleted(cursor: lmdb.Cursor[V], prefix: bytes) -> Iterator[tuple[bytes, V]]:
    """The entries whose keys start with `prefix`, each deleted once the caller has read it."""
    more = cursor.set_range(prefix)
    while more and bytes(cursor.key()[: len(prefix)]) == prefix:
        yield bytes(cursor.key()), cursor.value()
        more = cursor.delete()
