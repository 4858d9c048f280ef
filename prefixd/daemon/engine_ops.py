"""What an engine that holds blocks between a lookup and a load needs (LMCache's lookup-and-lock): a
pinning lookup, `unpin`, `delete` and `list`.

A pin keeps a block from eviction, so a tenant's pins are held to 1/PIN_SHARE of the store's
capacity: however much one tenant pins, the rest of the store stays evictable, and other tenants'
puts are never the only blocks eviction may take. A pinning lookup's hit ends where its tenant's
pins would pass that (a shorter hit, never a wrong one).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from functools import partial

from prefixd.daemon.context import Handler, Queries, Request, RequestContext
from prefixd.schema.identity import Identity
from prefixd.store import PrefixMatch
from prefixd.wire.messages import (
    Delete,
    DeleteReply,
    ListBlocks,
    ListedEntry,
    ListReply,
    LookupReply,
    RequestMessage,
    Unpin,
    UnpinReply,
    WireIdentity,
)

DEFAULT_LIST_LIMIT = 1024
PIN_SHARE = 4  # a tenant's pins hold at most a quarter of the store's capacity


async def pinned_lookup(
    ctx: RequestContext, rid: int, queries: Queries, reported: float | None, judged: bool = True
) -> LookupReply:
    """A lookup whose offered hits stay pinned for this connection until it unpins them or ends
    (a hit the benefit rule holds back is unpinned at once)."""
    services = ctx.services
    store, least = services.store, services.min_reusable_tokens
    identity, prompts = queries

    def run() -> list[PrefixMatch]:
        matches: list[PrefixMatch] = []
        try:
            for tokens, hashes in prompts:
                match = store.pin(identity, tokens, hashes=hashes)
                if match.n_tokens < least:
                    store.unpin(match.hashes)
                matches.append(match)
        except BaseException:  # a later prompt refused: the pins taken are nobody's
            store.unpin(offered(matches))
            raise
        return matches

    def offered(matches: list[PrefixMatch]) -> list[bytes]:
        return [h for m in matches if m.n_tokens >= least for h in m.hashes]

    def release_if_done(done: asyncio.Task[list[PrefixMatch]]) -> None:
        if not done.cancelled() and done.exception() is None:
            store.unpin(offered(done.result()))

    pinning = asyncio.ensure_future(services.run(run))
    try:
        matches = await asyncio.shield(pinning)
    except asyncio.CancelledError:  # the connection ended: its pins must not outlive it
        pinning.add_done_callback(release_if_done)
        raise
    try:
        matches = within_share(ctx, identity.tenant, matches)
        results, observed = services.lookup_results(
            identity, prompts, matches, reported, judged=judged
        )
        ctx.require_tenant(identity.tenant)  # a reload while pinning may have taken the tenant
    except BaseException:
        store.unpin(offered(matches))
        raise
    store.unpin(offered([m for m, r in zip(matches, results, strict=True) if r.withheld_tokens]))
    pairs = zip(matches, results, strict=True)  # what stays pinned, as `offered` says
    held = [m for m, r in pairs if not r.withheld_tokens and m.n_tokens >= least]
    blocks = [h for m in held for h in m.hashes]
    ctx.peer.pins.hold(identity.tenant, blocks, [size for m in held for size in m.payload_sizes])
    services.count(identity, observed)
    return LookupReply(id=rid, results=results)


def within_share(
    ctx: RequestContext, tenant: str, matches: Sequence[PrefixMatch]
) -> list[PrefixMatch]:
    """`matches`, each offered one cut where the tenant's pins would hold more than 1/PIN_SHARE of
    the store's capacity, its blocks past the cut unpinned (and all of it when what is left falls
    below `min_reusable_tokens`). On the loop, with nothing awaited before the pins are recorded."""
    services = ctx.services
    store, least = services.store, services.min_reusable_tokens
    room = store.capacity_bytes // PIN_SHARE - services.pinned_bytes[tenant]
    cut: list[PrefixMatch] = []
    for match in matches:
        if match.n_tokens < least:  # pinned not at all
            cut.append(match)
            continue
        kept, taken = 0, 0
        for size in match.payload_sizes:
            if taken + size > room:
                break
            kept, taken = kept + 1, taken + size
        if kept < match.n_blocks:
            short = dataclasses.replace(
                match, hashes=match.hashes[:kept], payload_sizes=match.payload_sizes[:kept]
            )
            if short.n_tokens < least:
                kept, taken = 0, 0
            store.unpin(match.hashes[kept:])
            services.pins_cut_blocks += match.n_blocks - kept
            match = short
        room -= taken
        cut.append(match)
    return cut


async def unpin(ctx: RequestContext, request: Request[Unpin]) -> UnpinReply:
    """Release one of this connection's pins of each closed block of each prompt (never another
    client's)."""
    services, pins = ctx.services, ctx.peer.pins
    identity, prompts = ctx.queries(request.message)
    store = services.store

    def held() -> list[bytes]:  # on the pool: a prompt may hold millions of blocks, few pinned
        return [b for tokens, _ in prompts for b in store.chain_of(identity, tokens) if b in pins]

    released = pins.release(identity.tenant, await services.run(held))
    store.unpin(released)
    return UnpinReply(id=request.id, released=len(released))


async def delete(ctx: RequestContext, request: Request[Delete]) -> DeleteReply:
    """Remove the last closed block of each prompt and every block below it, pinned or not."""
    services = ctx.services
    identity, prompts = ctx.queries(request.message)

    def run() -> int:
        if services.bridge is not None:
            services.bridge.settle()  # blocks read-throughs are installing go too
        lasts = []
        for tokens, _ in prompts:
            chain = services.store.chain_of(identity, tokens)
            if chain:
                lasts.append(chain[-1])
        return services.store.delete(lasts) if lasts else 0

    return DeleteReply(id=request.id, blocks=await services.run(run))


async def list_blocks(ctx: RequestContext, request: Request[ListBlocks]) -> ListReply:
    """A page of a tenant's stored blocks (the peer may use the tenant)."""
    msg, services = request.message, ctx.services
    ctx.require_tenant(msg.tenant)
    limit = DEFAULT_LIST_LIMIT if msg.limit is None else msg.limit
    found, after = await services.run(
        partial(services.store.list_blocks, tenant=msg.tenant, after=msg.after, limit=limit)
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


HANDLERS: dict[type[RequestMessage], Handler] = {
    Unpin: Handler(unpin),
    Delete: Handler(delete),
    ListBlocks: Handler(list_blocks),
}
