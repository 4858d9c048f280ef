"""Quarantine: a stored block that fails verification is dropped, with everything below it.

A read that meets a damaged record, payload or part never serves it; it names the block here and,
once its read transaction is over, the block goes in a write transaction of its own and is noted
in the quarantine table (hash -> when and why). A put that meets a damaged record replaces it in
its own transaction (prefixd.store.put), and `repair` quarantines what a check condemns.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import lmdb
import msgpack

from prefixd.schema.chain import BlockChain
from prefixd.store import counters
from prefixd.store.removal import remove_subtree
from prefixd.store.walk import Walk

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

log = logging.getLogger(__name__)

BAD_RECORD = "record fails verification"
BAD_PAYLOAD = "payload fails its checksum"
BAD_PART = "state-group payload fails verification"


class Damaged(NamedTuple):
    """A block that failed verification, the children-index key it hangs under, the identity it
    was read for, and why (its record may be too damaged to tell the first two)."""

    block: bytes
    parent_key: bytes
    identity: bytes
    reason: str


def quarantine(ctx: StoreContext, bad: Sequence[Damaged]) -> None:
    """Drop blocks that failed verification, and everything below them, in one transaction.
    If the disk refuses the write, they stay: they fail verification on every read anyway."""
    if not bad:
        return
    try:
        with ctx.writing() as txn:
            for h, parent_key, identity, reason in bad:
                dropped = remove_subtree(ctx, txn, h, parent_key, identity, reason="quarantined")
                if dropped:
                    note(ctx, txn, h, reason)
                    log.warning(
                        "quarantined a stored block (%s); %d block(s) with it", reason, dropped
                    )
    except lmdb.Error as exc:
        log.warning("could not quarantine %d damaged block(s) now: %s", len(bad), exc)


def note(ctx: StoreContext, txn: lmdb.Transaction, h: bytes, reason: str) -> None:
    """Record in `txn` that block `h` was quarantined, and why."""
    t = ctx.tables
    entry = msgpack.packb({"at_ns": ctx.clock.time_ns(), "reason": reason})
    txn.put(h, entry, db=t.quarantine)
    counters.add(txn, t.counters, counters.QUARANTINED, 1)


def met_by_walk(walk: Walk, chain: BlockChain) -> Damaged | None:
    """The block whose damaged record ended `walk`, if one did."""
    if walk.corrupt is None:
        return None
    parent = walk.hashes[-1] if walk.hashes else chain.identity.digest
    return Damaged(walk.corrupt, parent, chain.identity.digest, BAD_RECORD)


def damaged_parts(
    damaged: Sequence[bytes], chain: BlockChain, found: Sequence[bytes]
) -> list[Damaged]:
    """The blocks whose parts failed verification: dropping a block drops everything below it,
    so the joint entry is unreachable from that boundary on."""
    index = {h: i for i, h in enumerate(found)}
    digest = chain.identity.digest
    out = []
    for h in dict.fromkeys(damaged):
        i = index[h]
        parent = found[i - 1] if i else digest
        out.append(Damaged(h, parent, digest, BAD_PART))
    return out
