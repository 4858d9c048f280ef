"""The operations an engine that holds blocks between a lookup and a load needs (LMCache's
lookup-and-lock, then load, unlock, delete and listing): a lookup that pins its hits, `unpin`,
`delete` and `list`. Handlers of prefixd.daemon.operations.Operations, kept apart from the rest."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING

from prefixd.errors import ProtocolError
from prefixd.schema.identity import Identity
from prefixd.store import PrefixMatch
from prefixd.wire.errors import ErrorCode
from prefixd.wire.messages import (
    Delete,
    DeleteReply,
    ListBlocks,
    ListedEntry,
    ListReply,
    LookupReply,
    Unpin,
    UnpinReply,
    WireIdentity,
)

if TYPE_CHECKING:
    from prefixd.daemon.connection import Connection
    from prefixd.daemon.operations import Operations, Request

DEFAULT_LIST_LIMIT = 1024


async def pinned_lookup(
    ops: Operations,
    conn: Connection,
    rid: int,
    identity: Identity,
    queries: list[tuple[bytes | memoryview, bytes | None]],
) -> LookupReply:
    """A lookup whose hits stay pinned (kept from eviction) for this connection until it unpins
    them or ends (prefixd.store.pins); hits too short to offer are not pinned."""
    store, least = ops.store, ops.min_reusable_tokens

    def run() -> list[PrefixMatch]:
        matches = []
        for tokens, hashes in queries:
            match = store.pin(identity, tokens, hashes=hashes)
            if match.n_tokens < least:
                store.unpin(match.hashes)
            matches.append(match)
        return matches

    def offered(matches: list[PrefixMatch]) -> list[bytes]:
        return [h for m in matches if m.n_tokens >= least for h in m.hashes]

    def release_if_done(done: asyncio.Task[list[PrefixMatch]]) -> None:
        if not done.cancelled() and done.exception() is None:
            store.unpin(offered(done.result()))

    pinning = asyncio.ensure_future(ops._run(run))
    try:
        matches = await asyncio.shield(pinning)
    except asyncio.CancelledError:  # the connection ended: its pins must not outlive it
        pinning.add_done_callback(release_if_done)
        raise
    conn.pins.update(offered(matches))
    results, observed = ops._lookup_results(identity, queries, matches)
    ops._count(identity, observed)
    return LookupReply(id=rid, results=results)


async def unpin(ops: Operations, conn: Connection, request: Request[Unpin]) -> UnpinReply:
    """Release one of this connection's pins of each closed block of each prompt; blocks it
    holds no pin of are left alone (another client's pins are never touched)."""
    identity, queries = ops._lookup_queries(conn, request.message)
    chains = await ops._run(lambda: [ops.store.chain_of(identity, tokens) for tokens, _ in queries])
    released = []
    for chain in chains:
        for block in chain:
            if conn.pins.get(block, 0) > 0:
                conn.pins[block] -= 1
                if not conn.pins[block]:
                    del conn.pins[block]
                released.append(block)
    ops.store.unpin(released)
    return UnpinReply(id=request.id, released=len(released))


async def delete(ops: Operations, conn: Connection, request: Request[Delete]) -> DeleteReply:
    """Remove the last closed block of each prompt and every block below it (an engine that
    evicts by its own policy). Pinned or not: a pin only holds prefixd's eviction off."""
    identity, queries = ops._lookup_queries(conn, request.message)

    def run() -> int:
        if ops.bridge is not None:
            ops.bridge.settle()  # blocks read-throughs are installing go too
        lasts = []
        for tokens, _ in queries:
            chain = ops.store.chain_of(identity, tokens)
            if chain:
                lasts.append(chain[-1])
        return ops.store.delete(lasts) if lasts else 0

    return DeleteReply(id=request.id, blocks=await ops._run(run))


async def list_blocks(ops: Operations, conn: Connection, request: Request[ListBlocks]) -> ListReply:
    """A page of a tenant's stored blocks (prefixd.store.listing): keys the peer may see, since
    it may use the tenant."""
    msg = request.message
    if not conn.grant.may_use(msg.tenant):
        raise ProtocolError(
            ErrorCode.FORBIDDEN, f"uid {conn.uid} may not use tenant {msg.tenant!r}"
        )
    limit = DEFAULT_LIST_LIMIT if msg.limit is None else msg.limit
    found, after = await ops._run(
        partial(ops.store.list_blocks, tenant=msg.tenant, after=msg.after, limit=limit)
    )
    index: dict[Identity, int] = {}
    blocks = [
        ListedEntry(
            identity=index.setdefault(b.identity, len(index)), tokens=b.tokens, size=b.payload_size
        )
        for b in found
    ]
    identities = [WireIdentity.of(identity) for identity in index]
    return ListReply(id=request.id, identities=identities, blocks=blocks, next=after)
