"""The operations that look after the store rather than serve a prompt: `stats`, `health`, `purge`,
`verify` and `hot`; the administrative ones are checked against the peer's grant.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

from prefixd.daemon.context import Handler, Request, RequestContext
from prefixd.daemon.fields import packed
from prefixd.errors import ConfigError, ProtocolError
from prefixd.store import PurgeSelector, check_report
from prefixd.wire.errors import ErrorCode
from prefixd.wire.messages import (
    Health,
    HealthReply,
    Hot,
    HotEntry,
    HotReply,
    Purge,
    PurgeReply,
    RequestMessage,
    Stats,
    StatsReply,
    Verify,
    WireIdentity,
)

DEFAULT_HOT_LIMIT = 64


async def stats(ctx: RequestContext, request: Request[Stats]) -> StatsReply:
    services = ctx.services
    store = await services.run(services.store.stats)
    metrics = await services.run(services.metrics.snapshot)
    grant = ctx.peer.grant
    if grant.tenants is not None:  # tenants apart: a confined peer sees its own, the node's totals
        metrics["tenants"] = {t: v for t, v in metrics["tenants"].items() if grant.may_use(t)}
    if services.bridge is not None:
        metrics["cluster"] = {**services.bridge.snapshot(), **services.cluster_hits}
    server = {
        **services.server_counters(),
        **services.warmed,
        "pinned_bytes": sum(services.pinned_bytes.values()),
        "pins_cut_blocks": services.pins_cut_blocks,
        "models": dict(services.models),
    }
    return StatsReply(
        id=request.id, store=dataclasses.asdict(store), server=server, metrics=metrics
    )


async def health(ctx: RequestContext, request: Request[Health]) -> HealthReply:
    services = ctx.services
    store = services.store
    await services.run(store.stats)  # the store answers through the pool
    return HealthReply(
        id=request.id,
        # a failed fsync: writes refused, reads served (prefixd.store.sync_state)
        status="ok" if store.sync_failure is None else "sync_failed",
        uptime_s=round(services.clock.monotonic() - services.started, 3),
        connections=services.open_connections(),
        data_dir=str(store.path),
    )


async def purge(ctx: RequestContext, request: Request[Purge]) -> PurgeReply:
    msg, services = request.message, ctx.services
    try:
        selector = PurgeSelector(
            tenant=msg.tenant,
            model=msg.model,
            keep=dict(msg.keep or {}),
            older_than_s=msg.older_than_s,
            everything=bool(msg.everything),
        )
    except ConfigError as exc:
        raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
    # a purge of one tenant needs that tenant; any other (a model, an age, all) every tenant
    ctx.require_op("purge", every_tenant=msg.tenant is None)
    if msg.tenant is not None:
        ctx.require_tenant(msg.tenant)
    # on the administrative thread, queued one at a time: never on the workers that serve
    # lookups and loads, however many purges a peer pipelines
    # an operator's purge: keeping a version no identity holds (a typo) removes nothing
    if msg.dry_run:
        call = partial(services.store.purge, selector, dry_run=True, keep_known=True)
    else:
        call = partial(services.purge_everywhere, selector, keep_known=True)
    report = await services.run(call, services.admin_pool)
    return PurgeReply(
        id=request.id,
        identities=report.identities,
        blocks=report.blocks,
        payload_bytes=report.payload_bytes,
        stored_bytes=report.stored_bytes,
        dry_run=report.dry_run,
        seconds=report.seconds,
        unknown=list(report.unknown),
    )


async def verify(ctx: RequestContext, request: Request[Verify]) -> dict[str, Any]:
    """Check the store while serving (a read snapshot), or repair it (one write transaction)."""
    msg, services = request.message, ctx.services
    ctx.require_op("verify")
    run = partial(
        check_report.verify, services.store, fix=bool(msg.fix), payloads=msg.payloads is not False
    )
    if services.verifying:
        raise ProtocolError(
            ErrorCode.BUSY, "a verify is already running: ask again when it is done"
        )
    services.verifying = True
    try:
        return {"id": request.id, "ok": True, **await services.run(run, services.admin_pool)}
    finally:
        services.verifying = False


async def hot(ctx: RequestContext, request: Request[Hot]) -> HotReply:
    """A tenant's most valuable prefixes to warm after a restart, within a byte budget and half a
    frame of token ids."""
    msg, services = request.message, ctx.services
    ctx.require_op("hot")
    ctx.require_tenant(msg.tenant)
    limit = DEFAULT_HOT_LIMIT if msg.limit is None else msg.limit  # at most MAX_HOT_PREFIXES
    found = await services.run(
        partial(services.store.hottest, msg.budget_bytes, tenant=msg.tenant, limit=limit)
    )
    room = services.max_frame_bytes // 2
    prefixes = []
    for prefix in found:
        room -= len(prefix.tokens) + 1024
        if room < 0:
            break
        prefixes.append(
            HotEntry(
                identity=WireIdentity.of(prefix.identity),
                tokens=prefix.tokens,
                sizes=packed(prefix.payload_sizes),
                score=prefix.score,
            )
        )
    services.warmed["warm_listings"] += 1
    return HotReply(id=request.id, prefixes=prefixes)


HANDLERS: dict[type[RequestMessage], Handler] = {
    Stats: Handler(stats),
    Health: Handler(health, while_stopping=True),
    Purge: Handler(purge),
    Verify: Handler(verify),
    Hot: Handler(hot),
}
