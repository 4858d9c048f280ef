"""The operations of hybrid identities: `put_state`, `lookup_state` and `load_state`, with the
shared tier's part (a put publishes; a lookup or load reads through from the joint boundary).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from prefixd.daemon.context import Handler, Request, RequestContext
from prefixd.daemon.fields import closed_tokens, region_output
from prefixd.daemon.services import Observed, Services
from prefixd.schema.chain import BlockChain
from prefixd.schema.identity import Identity
from prefixd.store.results import JointMatch, PutResult, StateLoad
from prefixd.wire.messages import (
    JointResult,
    LoadState,
    LoadStateReply,
    LookupState,
    LookupStateReply,
    PutState,
    PutStateReply,
    RequestMessage,
    StatePart,
)


async def put_state(ctx: RequestContext, request: Request[PutState]) -> PutStateReply:
    msg, services, peer = request.message, ctx.services, ctx.peer
    identity = ctx.identity(msg.identity)
    tokens = ctx.prompt(msg)
    paged_spans = msg.paged or {}  # at most MAX_BLOCKS_PER_PUT in all (decode_request)
    checkpoint_spans = msg.checkpoints or {}
    spans = [s for group in paged_spans.values() for s in group]
    spans += [s for pairs in checkpoint_spans.values() for _, s in pairs]
    views = iter(peer.payloads(spans))  # refused whole if they name more than their regions hold
    paged = {name: [next(views) for _ in spans] for name, spans in paged_spans.items()}
    checkpoints = {
        name: {boundary: next(views) for boundary, _ in pairs}
        for name, pairs in checkpoint_spans.items()
    }
    first_block, upto_tokens = msg.first_block or 0, msg.upto_tokens
    bridge = services.bridge

    def run() -> tuple[PutResult, list[bytes]]:
        result = services.store.put_state(
            identity,
            tokens,
            paged=paged,
            checkpoints=checkpoints,
            upto_tokens=upto_tokens,
            first_block=first_block,
        )
        if bridge is None or not (result.stored or result.parts):
            return result, []
        # blocks before the put's first that it hung a checkpoint on are published again
        bt = identity.block_tokens
        earlier = {b // bt - 1 for pairs in checkpoints.values() for b in pairs}
        chain = BlockChain(services.store.namespace(identity), tokens)  # as they are stored
        hashes = [chain.hash(i) for i in sorted(earlier) if i < first_block]
        return result, hashes + list(result.hashes)

    result, published = await services.run(run)
    if bridge is not None and published:
        bridge.published(identity, published)
    return PutStateReply(
        id=request.id, stored=result.stored, existed=result.existed, parts=result.parts
    )


async def lookup_state(ctx: RequestContext, request: Request[LookupState]) -> LookupStateReply:
    services = ctx.services
    identity, prompts = ctx.queries(request.message)

    def run() -> list[JointMatch]:
        return [joint_match(services, identity, t, h) for t, h in prompts]

    matches = await services.run(run)
    results, observed = [], []
    rate = services.benefit.report(identity.tenant, request.message.prefill_tokens_per_s)
    for (tokens, _), found in zip(prompts, matches, strict=True):
        found_tokens = found.reusable_tokens
        benefit = services.benefit.judge(identity.tenant, found_tokens, found.payload_bytes, rate)
        match = found if services.benefit.offered(found_tokens, benefit) else no_hit(found)
        hit_tokens, hit_bytes = match.reusable_tokens, match.payload_bytes
        results.append(
            JointResult(
                reusable_tokens=match.reusable_tokens,
                replay_from=match.replay_from,
                paged_tokens=match.paged_tokens,
                matched_tokens=match.matched_tokens,
                parts=state_parts(match),
                est_load_s=benefit.load_s,
                est_prefill_s=benefit.prefill_s,
                withheld_tokens=found_tokens - hit_tokens,
            )
        )
        prompt_tokens = closed_tokens(tokens, identity)
        observed.append(Observed(prompt_tokens, hit_tokens, hit_bytes, hit_tokens < found_tokens))
    services.count(identity, observed)
    return LookupStateReply(id=request.id, results=results)


def joint_match(
    services: Services, identity: Identity, tokens: bytes | memoryview, hashes: bytes | None
) -> JointMatch:
    """The local joint match, extended from the shared tier first when set."""
    store, bridge = services.store, services.bridge
    match = store.lookup_state(identity, tokens, hashes=hashes)
    if bridge is None:
        return match
    local = match.reusable_tokens // identity.block_tokens
    remote = bridge.read_through(identity, tokens, local)
    services.cluster_hits["local_hit_blocks"] += local
    services.cluster_hits["remote_hit_blocks"] += remote
    return store.lookup_state(identity, tokens, hashes=hashes) if remote else match


def offered(services: Services, match: JointMatch) -> JointMatch:
    """`match`, or no hit when shorter than `min_reusable_tokens`."""
    return match if match.reusable_tokens >= services.min_reusable_tokens else no_hit(match)


def no_hit(match: JointMatch) -> JointMatch:
    return dataclasses.replace(match, reusable_tokens=0, replay_from=0, hashes=(), parts=())


async def load_state(ctx: RequestContext, request: Request[LoadState]) -> LoadStateReply:
    msg, services = request.message, ctx.services
    identity = ctx.identity(msg.identity)
    tokens = ctx.prompt(msg)
    offset, out = region_output(ctx.peer, msg)
    started = time.perf_counter()
    deadline = services.deadline(msg.deadline_s)

    def run() -> StateLoad:
        if services.bridge is not None:
            joint_match(services, identity, tokens, msg.hashes)
        return services.store.load_state(
            identity, tokens, out, hashes=msg.hashes, deadline=deadline
        )

    result = await services.run(run)
    match = offered(services, result.match)
    services.metrics.observe_load(
        identity.tenant,
        match.reusable_tokens,
        match.payload_bytes,
        time.perf_counter() - started,
    )
    return LoadStateReply(
        id=request.id,
        reusable_tokens=match.reusable_tokens,
        replay_from=match.replay_from,
        paged_tokens=match.paged_tokens,
        matched_tokens=match.matched_tokens,
        parts=state_parts(match, [offset + o for o in result.offsets]),
    )


def state_parts(match: JointMatch, offsets: Sequence[int] | None = None) -> list[StatePart]:
    """A joint match's parts on the wire; with `offsets`, where each was loaded."""
    return [
        StatePart(
            group=part.group,
            first_token=part.first_token,
            tokens=part.tokens,
            size=part.payload_size,
            offset=None if offsets is None else offsets[i],
        )
        for i, part in enumerate(match.parts)
    ]


HANDLERS: dict[type[RequestMessage], Handler] = {
    PutState: Handler(put_state),
    LookupState: Handler(lookup_state),
    LoadState: Handler(load_state),
}
