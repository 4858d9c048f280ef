"""What a client does first: `hello` (the protocol, the daemon's limits, retiring model versions the
engine no longer serves) and `attach` (a shared memory region).
"""

from __future__ import annotations

import asyncio
from functools import partial

from prefixd.daemon.context import Answered, Handler, Later, Request, RequestContext
from prefixd.daemon.inbox import close_fds
from prefixd.errors import ProtocolError
from prefixd.store import PurgeSelector
from prefixd.version import __version__
from prefixd.wire.errors import ErrorCode
from prefixd.wire.frames import PROTOCOL_VERSION
from prefixd.wire.messages import Attach, AttachReply, Hello, HelloReply, RequestMessage
from prefixd.wire.region import MappedRegion

MAX_REGIONS_PER_CONNECTION = 16


async def hello(ctx: RequestContext, request: Request[Hello]) -> HelloReply:
    msg = request.message
    _check_protocol(msg)
    retired = 0
    if msg.serves:
        ctx.require_op("retire", every_tenant=True)  # retiring touches every tenant
    services = ctx.services
    for served in msg.serves or ():
        # the engine serves these weights now: other versions of the model are stale
        selector = PurgeSelector(model=served.model, keep={"weights": served.weights})
        retired += await services.run(partial(services.retire, selector))
    return _greet(ctx, request.id, retired)


def hello_now(ctx: RequestContext, request: Request[Hello]) -> Answered | Later:
    """A hello that retires nothing is answered on the loop."""
    if request.message.serves:
        return partial(hello, ctx, request)
    _check_protocol(request.message)
    return Answered(_greet(ctx, request.id, 0))


def _greet(ctx: RequestContext, rid: int, retired: int) -> HelloReply:
    services, peer = ctx.services, ctx.peer
    peer.greeted = True
    return HelloReply(
        id=rid,
        protocol=PROTOCOL_VERSION,
        server=f"prefixd/{__version__}",
        ops=services.ops,
        max_frame_bytes=services.max_frame_bytes,
        max_region_bytes=services.max_region_bytes,
        max_inflight=peer.max_inflight,
        models=dict(services.models),
        retired=retired,
        instance=services.instance,
    )


def _check_protocol(msg: Hello) -> None:
    if msg.protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"client speaks protocol {msg.protocol}, this daemon speaks {PROTOCOL_VERSION}",
        )


async def attach(ctx: RequestContext, request: Request[Attach]) -> AttachReply:
    rid, size = request.id, request.message.size
    most = ctx.services.max_region_bytes
    fds = list(request.fds)
    try:
        if size > most:
            raise ProtocolError(ErrorCode.BAD_REQUEST, f"attach: size must be in [1, {most}]")
        if len(fds) != 1:
            raise ProtocolError(
                ErrorCode.BAD_REGION,
                f"attach needs exactly one memfd sent with its frame, got {len(fds)}",
            )
        if len(ctx.peer.regions) + ctx.peer.attaching >= MAX_REGIONS_PER_CONNECTION:
            raise ProtocolError(
                ErrorCode.BAD_REGION, f"at most {MAX_REGIONS_PER_CONNECTION} regions per connection"
            )
        fd = fds.pop()
    finally:
        close_fds(fds)
    ctx.peer.attaching += 1  # counted before the awaits: attaches sent together see each other
    try:
        region = await ctx.services.run(partial(MappedRegion, fd, size, most))
        try:  # mapped in now, not page by page in the first load; off the workers and the loop
            await asyncio.get_running_loop().run_in_executor(None, region.populate)
        except BaseException:
            region.close()
            raise
        return AttachReply(id=rid, region=ctx.peer.add_region(region), size=size)
    finally:
        ctx.peer.attaching -= 1


HANDLERS: dict[type[RequestMessage], Handler] = {
    Hello: Handler(hello, now=hello_now, before_hello=True),
    Attach: Handler(attach, takes_fds=True),
}
