"""The operations an engine runs for every prompt: `put`, `lookup`, `load` and `route`. Handlers
check what the schema cannot say, then run store work on the pool so the loop never blocks on disk,
checksums or zstd.
"""

from __future__ import annotations

import time
from functools import partial

from prefixd.daemon import engine_ops, routing
from prefixd.daemon.context import Answered, Handler, Later, Queries, Request, RequestContext
from prefixd.daemon.fields import packed, region_output
from prefixd.daemon.services import on_loop
from prefixd.store import PrefixMatch
from prefixd.store.results import LoadResult
from prefixd.wire.messages import (
    Load,
    LoadReply,
    Lookup,
    LookupReply,
    Put,
    PutReply,
    RequestMessage,
    Route,
    RouteReply,
)

# The most token bytes a lookup answered on the event loop may hold (tens of microseconds)
LOOP_TOKEN_BYTES = 512 << 10


async def put(ctx: RequestContext, request: Request[Put]) -> PutReply:
    msg, services = request.message, ctx.services
    identity = ctx.identity(msg.identity)
    tokens = ctx.prompt(msg)
    first_block = msg.first_block or 0
    views = ctx.peer.payloads(msg.blocks)
    result = await services.run(
        partial(services.store.put, identity, tokens, views, first_block=first_block)
    )
    if services.bridge is not None and result.stored:
        services.bridge.published(identity, result.hashes[len(result.hashes) - result.stored :])
    services.metrics.observe_put(
        identity.tenant,
        identity.digest,
        result.stored,
        len(views) * identity.block_tokens,
        sum(len(v) for v in views),
    )
    return PutReply(id=request.id, stored=result.stored, existed=result.existed)


def lookup_now(ctx: RequestContext, request: Request[Lookup]) -> Answered | Later:
    """The reply when memory alone answers every prompt, computed on the loop (with the counting to
    do once it is sent); else the lookup's work for a task."""
    msg = request.message
    queries, reported, judged = ctx.queries(msg), msg.prefill_tokens_per_s, not msg.stored_only
    if msg.pin:
        return partial(engine_ops.pinned_lookup, ctx, request.id, queries, reported, judged)
    later = partial(lookup_queries, ctx, request.id, queries, reported, judged)
    if sum(len(tokens) for tokens, _ in queries.prompts) > LOOP_TOKEN_BYTES:
        return later  # work for a worker
    services = ctx.services
    cached = on_loop(partial(services.store.cached_prefixes, queries.identity, queries.prompts))
    if cached is None:
        return later
    results, observed = services.lookup_results(
        queries.identity, queries.prompts, list(cached), reported, judged=judged
    )
    reply = LookupReply(id=request.id, results=results)
    return Answered(reply, partial(services.count, queries.identity, observed))


async def lookup(ctx: RequestContext, request: Request[Lookup]) -> LookupReply:
    msg = request.message
    queries, reported, judged = ctx.queries(msg), msg.prefill_tokens_per_s, not msg.stored_only
    if msg.pin:
        return await engine_ops.pinned_lookup(ctx, request.id, queries, reported, judged)
    return await lookup_queries(ctx, request.id, queries, reported, judged)


async def lookup_queries(
    ctx: RequestContext, rid: int, queries: Queries, reported: float | None, judged: bool = True
) -> LookupReply:
    """Prompts verified recently are answered without a thread hop, the rest on the pool."""
    services = ctx.services
    identity, prompts = queries
    cached_prefix = services.store.cached_prefix
    matches: list[PrefixMatch | None] = on_loop(
        lambda: [cached_prefix(identity, tokens, hashes=hashes) for tokens, hashes in prompts]
    )
    missing = [i for i, match in enumerate(matches) if match is None]
    if missing:

        def run() -> list[PrefixMatch]:
            return [services.longest_prefix(identity, *prompts[i]) for i in missing]

        for i, match in zip(missing, await services.run(run)):
            matches[i] = match
    results, observed = services.lookup_results(identity, prompts, matches, reported, judged=judged)
    services.count(identity, observed)
    return LookupReply(id=rid, results=results)


async def load(ctx: RequestContext, request: Request[Load]) -> LoadReply:
    msg, services = request.message, ctx.services
    identity = ctx.identity(msg.identity)
    tokens = ctx.prompt(msg)
    offset, out = region_output(ctx.peer, msg)
    first_block = msg.first_block or 0
    started = time.perf_counter()
    deadline = services.deadline(msg.deadline_s)
    services.loads.started()
    result = LoadResult(0, 0, (), ())
    try:
        result = await services.run(
            partial(
                services.load,
                identity,
                tokens,
                out,
                max_blocks=msg.max_blocks,
                hashes=msg.hashes,
                first_block=first_block,
                deadline=deadline,
            )
        )
    finally:
        services.loads.finished(sum(result.sizes))
    ended = not result.next_size and (msg.max_blocks is None or result.n_blocks < msg.max_blocks)
    if not first_block and ended and result.n_tokens < services.min_reusable_tokens:
        result = LoadResult(0, 0, (), ())  # a whole hit too short to be worth it: not offered
    if msg.warm:
        services.warmed["warmed_blocks"] += result.n_blocks
        services.warmed["warmed_bytes"] += sum(result.sizes)
    services.metrics.observe_load(
        identity.tenant,
        result.n_blocks * identity.block_tokens,
        sum(result.sizes),
        time.perf_counter() - started,
    )
    return LoadReply(
        id=request.id,
        n_blocks=result.n_blocks,
        n_tokens=result.n_tokens,
        offsets=packed([offset + o for o in result.offsets]),
        sizes=packed(result.sizes),
        first_block=result.first_block,
        next_size=result.next_size,
    )


async def route(ctx: RequestContext, request: Request[Route]) -> RouteReply:
    msg, services = request.message, ctx.services
    identity = ctx.identity(msg.identity)
    tokens = ctx.prompt(msg)
    match = None
    if len(tokens) <= LOOP_TOKEN_BYTES:  # as lookups: short prompts from memory, on the loop
        match = on_loop(partial(services.store.cached_prefix, identity, tokens, hashes=msg.hashes))
    if match is None:
        match = await services.run(partial(services.longest_prefix, identity, tokens, msg.hashes))
    [result], _ = services.lookup_results(identity, [(tokens, msg.hashes)], [match])
    return routing.answer(
        request.id,
        result.n_blocks,
        result.n_tokens,
        match.payload_bytes if result.n_blocks else 0,
        load_time=services.metrics.load_times.of(identity.tenant),
        prefill_tokens_per_s=services.metrics.rates.of(identity.tenant),
        queue=services.loads,
    )


HANDLERS: dict[type[RequestMessage], Handler] = {
    Put: Handler(put),
    Lookup: Handler(lookup, now=lookup_now),
    Load: Handler(load),
    Route: Handler(route),
}
