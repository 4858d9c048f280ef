"""Which prefixes to bring back first after a restart: blocks by eviction value, highest first, each
taking its missing ancestors along within the budget; the answer is the tips of what was taken, as
whole prefixes. Hybrid identities are left out."""

from __future__ import annotations

import dataclasses
import heapq
from typing import TYPE_CHECKING

import lmdb

from prefixd.schema.chain import ROOT_PARENT
from prefixd.schema.identity import Identity
from prefixd.schema.records import AccessRecord, BlockRecord
from prefixd.schema.stored import HotPrefix
from prefixd.store.eviction import value_per_byte
from prefixd.store.tables import Tables, readable_identities, records_after

if TYPE_CHECKING:
    from prefixd.store.access import AccessTimes
    from prefixd.store.context import StoreContext
    from prefixd.store.tenancy import Tenancy


def hottest(
    ctx: StoreContext,
    tenancy: Tenancy,
    access: AccessTimes,
    budget_bytes: int,
    tenant: str,
    limit: int,
) -> list[HotPrefix[bytes]]:
    """`hottest_prefixes` after writing pending read times; a share group's tenant gets the group's
    prefixes, named with its own identity."""
    stored_as = tenancy.stored_as(tenant)
    access.sync()
    with ctx.env.begin() as txn:
        found = hottest_prefixes(
            txn, ctx.tables, ctx.clock.time_ns(), budget_bytes, limit, stored_as
        )
    if stored_as == tenant:
        return found
    return [
        dataclasses.replace(p, identity=dataclasses.replace(p.identity, tenant=tenant))
        for p in found
    ]


def hottest_prefixes(
    txn: lmdb.Transaction, t: Tables, now_ns: int, budget_bytes: int, limit: int, tenant: str
) -> list[HotPrefix[bytes]]:
    """At most `limit` of `tenant`'s prefixes within `budget_bytes` of payload (a tenant never
    learns another's prompts)."""
    records: dict[bytes, BlockRecord] = {}
    ranked: list[tuple[float, bytes]] = []
    plain = _plain_identities(txn, t, tenant)
    for block, record in records_after(txn, t, None):
        if record is None or record.identity not in plain:
            continue
        records[block] = record
        access = AccessRecord.read(txn.get(block, db=t.access), record.created_ns)
        tokens = plain[record.identity].block_tokens
        ranked.append((-value_per_byte(record, access, now_ns, tokens), block))
    heapq.heapify(ranked)
    taken: dict[bytes, float] = {}
    spent = 0
    while ranked:
        negative_score, block = heapq.heappop(ranked)
        if block in taken:
            continue
        chain = _missing_ancestry(block, records, taken)
        if chain is None:
            continue  # an ancestor is not stored (damaged): nothing below it can be loaded
        cost = sum(records[b].payload_size for b in chain)
        if spent + cost > budget_bytes:
            continue  # a cheaper block further down the ranking may still fit
        spent += cost
        for b in chain:
            taken[b] = -negative_score
    parents = {records[b].parent for b in taken}
    tips = sorted((b for b in taken if b not in parents), key=lambda b: -taken[b])[:limit]
    return [_prefix(tip, records, plain, taken[tip]) for tip in tips]


def _plain_identities(txn: lmdb.Transaction, t: Tables, tenant: str) -> dict[bytes, Identity]:
    return {
        digest: identity
        for digest, identity in readable_identities(txn, t)
        if identity.state is None and identity.tenant == tenant
    }


def _missing_ancestry(
    block: bytes, records: dict[bytes, BlockRecord], taken: dict[bytes, float]
) -> list[bytes] | None:
    """`block` and its ancestors not yet taken, or None if one is missing."""
    chain = []
    current = block
    while current not in taken:
        record = records.get(current)
        if record is None:
            return None
        chain.append(current)
        if record.parent == ROOT_PARENT:
            break
        current = record.parent
    return chain


def _prefix(
    tip: bytes, records: dict[bytes, BlockRecord], plain: dict[bytes, Identity], score: float
) -> HotPrefix[bytes]:
    chain = [tip]
    while records[chain[-1]].parent != ROOT_PARENT:
        chain.append(records[chain[-1]].parent)
    chain.reverse()
    return HotPrefix(
        plain[records[tip].identity],
        b"".join(records[b].tokens for b in chain),
        tuple(records[b].payload_size for b in chain),
        score,
    )
