"""The operations on hybrid identities (state groups: paged KV beside checkpoints): steps of the
client core like the plain ones in operations.py, which binds them to the clients."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from prefixd.client.core import ClientCore
from prefixd.client.leases import Lease
from prefixd.client.results import StateLoaded, StateLookup, Stored
from prefixd.client.steps import Reserve, Steps, holding, released_on_error, spans_of
from prefixd.errors import RegionError
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import PromptIds
from prefixd.wire import messages as wire


def put_state(
    core: ClientCore,
    identity: Identity,
    token_ids: PromptIds,
    *,
    paged: Mapping[str, Sequence[Any]] | None = None,
    checkpoints: Mapping[str, Mapping[int, Any]] | None = None,
    upto_tokens: int | None = None,
    first_block: int = 0,
) -> Steps[Stored]:
    """Stage and publish a hybrid identity's state groups (see Store.put_state): every group's
    payloads back to back in the region, in one put."""
    paged, checkpoints = paged or {}, checkpoints or {}
    payloads = [p for name in paged for p in paged[name]]
    payloads += [p for name in checkpoints for p in checkpoints[name].values()]
    with holding() as held:
        staged = yield from core.stage(payloads, held)
        spans = iter(staged)
        reply: wire.PutStateReply = yield from core.prompted_call(
            wire.PutState,
            identity,
            token_ids,
            spans_of(held),
            first_block=first_block,
            upto_tokens=upto_tokens,
            paged={name: [next(spans) for _ in paged[name]] for name in paged},
            checkpoints={
                name: [(boundary, next(spans)) for boundary in placed]
                for name, placed in checkpoints.items()
            },
        )
    return Stored(reply.stored, reply.existed, reply.parts)


def lookup_state(
    core: ClientCore,
    identity: Identity,
    prompts: Sequence[PromptIds],
    *,
    hashes: Sequence[bytes | None] | None = None,
    prefill_tokens_per_s: float | None = None,
) -> Steps[list[StateLookup]]:
    """The joint hit of each prompt for a hybrid identity worth loading (one round trip);
    `prefill_tokens_per_s`: the engine's measured prefill throughput, for the benefit rule."""
    reply: wire.LookupStateReply = yield from core.prompts_call(
        wire.LookupState, identity, prompts, hashes, prefill_tokens_per_s=prefill_tokens_per_s
    )
    return [
        StateLookup(
            r.reusable_tokens,
            r.replay_from,
            r.paged_tokens,
            r.matched_tokens,
            tuple(r.parts),
            r.est_load_s,
            r.est_prefill_s,
            r.withheld_tokens,
        )
        for r in reply.results
    ]


def load_state(
    core: ClientCore,
    identity: Identity,
    token_ids: PromptIds,
    *,
    length: int | None = None,
    deadline_s: float | None = None,
) -> Steps[StateLoaded]:
    """Load every verified payload of the joint hit, back to back into leased region space;
    each part's `view` holds its bytes until the result is released. Past `deadline_s` seconds
    (default: the daemon's load_deadline_s) the daemon stops reading and answers a miss."""
    allocator = core.require_payloads()
    lease = yield Reserve.up_to(allocator, length)
    try:
        result = yield from _load_state_span(core, identity, token_ids, lease, deadline_s)
    except RegionError:
        lease.release()
        if length is not None or lease.size >= allocator.size:
            raise
        # others held space and the hit did not fit: once more with a lease of its size
        [hit] = yield from lookup_state(core, identity, [token_ids])
        lease = yield Reserve(allocator, min(max(hit.payload_bytes, 1), allocator.size))
        with released_on_error(lease):
            result = yield from _load_state_span(core, identity, token_ids, lease, deadline_s)
    except BaseException:
        lease.release()
        raise
    parts = result.parts
    with released_on_error(lease):
        views = lease.loaded([p.offset or 0 for p in parts], [p.size for p in parts])
    loaded = tuple(msgspec.structs.replace(p, view=view) for p, view in zip(parts, views))
    return StateLoaded(
        result.reusable_tokens,
        result.replay_from,
        result.paged_tokens,
        result.matched_tokens,
        loaded,
        lease=lease,
    )


def _load_state_span(
    core: ClientCore,
    identity: Identity,
    token_ids: PromptIds,
    lease: Lease,
    deadline_s: float | None,
) -> Steps[wire.LoadStateReply]:
    reply: wire.LoadStateReply = yield from core.prompted_call(
        wire.LoadState,
        identity,
        token_ids,
        (lease.span,),
        region=core.region_id(core.require_payloads()),
        offset=lease.offset,
        length=lease.size,
        deadline_s=deadline_s,
    )
    return reply
