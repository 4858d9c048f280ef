"""Quarantine: a stored block that fails verification is dropped, with everything below it, once the
read that met it is over, and noted in the quarantine table."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import lmdb
import msgpack

from prefixd.errors import SyncFailedError
from prefixd.schema.chain import BlockChain
from prefixd.store import counters
from prefixd.store.derived import rebuild_derived
from prefixd.store.removal import remove_subtree
from prefixd.store.walk import Walk

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

log = logging.getLogger(__name__)

BAD_RECORD = "record fails verification"
BAD_PAYLOAD = "payload fails its checksum"
BAD_PART = "state-group payload fails verification"


class Damaged(NamedTuple):
    """A block that failed verification, where it hangs, the identity it was read for, and why (its
    record may be too damaged to tell)."""

    block: bytes
    parent_key: bytes
    identity: bytes
    reason: str


def quarantine(ctx: StoreContext, bad: Sequence[Damaged]) -> int:
    """Drop these blocks and their subtrees in one transaction; how many went. If the disk
    refuses, or an fsync failed (the store writes nothing more), they stay: they fail
    verification on every read."""
    if not bad:
        return 0
    total = 0
    try:
        with ctx.writing() as txn:
            for h, parent_key, identity, reason in bad:
                dropped = remove_subtree(ctx, txn, h, parent_key, identity, reason="quarantined")
                if dropped:
                    note(ctx, txn, h, reason)
                    log.warning(
                        "quarantined a stored block (%s); %d block(s) with it", reason, dropped
                    )
                total += dropped
    except (lmdb.Error, SyncFailedError) as exc:
        log.warning("could not quarantine %d damaged block(s) now: %s", len(bad), exc)
        return 0
    return total


def condemn(ctx: StoreContext, txn: lmdb.Transaction, reasons: dict[bytes, str]) -> tuple[int, int]:
    """Quarantine each block of `reasons` with its subtree in `txn`, then rebuild what derives from
    the records left; (blocks removed, derived entries changed)."""
    removed = 0
    for block, reason in reasons.items():
        if txn.get(block, db=ctx.tables.blocks) is None:
            continue  # gone below another, or a part hung on no block: the rebuild drops it
        removed += remove_subtree(ctx, txn, block, reason="quarantined")
        note(ctx, txn, block, reason)
    return removed, rebuild_derived(txn, ctx.tables, ctx.clock.time_ns())


def note(ctx: StoreContext, txn: lmdb.Transaction, h: bytes, reason: str) -> None:
    t = ctx.tables
    entry = msgpack.packb({"at_ns": ctx.clock.time_ns(), "reason": reason})
    txn.put(h, entry, db=t.quarantine)
    counters.add(txn, t.counters, counters.QUARANTINED, 1)


def met_by_walk(walk: Walk, chain: BlockChain) -> Damaged | None:
    if walk.corrupt is None:
        return None
    parent = walk.hashes[-1] if walk.hashes else chain.identity.digest
    return Damaged(walk.corrupt, parent, chain.identity.digest, BAD_RECORD)


def damaged_parts(
    damaged: Sequence[bytes], chain: BlockChain, found: Sequence[bytes]
) -> list[Damaged]:
    digest = chain.identity.digest
    parents = dict(zip(found, [digest, *found]))
    # a page hung below the chain is a longer prompt's: its own reads quarantine it
    return [
        Damaged(h, parents[h], digest, BAD_PART) for h in dict.fromkeys(damaged) if h in parents
    ]
