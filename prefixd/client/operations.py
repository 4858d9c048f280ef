"""Every operation of the clients, declared once as a function of the core that makes its steps
(prefixd.client.steps). The `Operation` descriptor binds it to both clients: `Client.load(...)`
drives the steps to the result, `AsyncClient.load(...)` returns a coroutine of it, and mypy checks
both calls against the function's own parameters. Adding an operation: its message and reply
(prefixd.wire.messages), its daemon handler, and here its steps and one line in `Operations`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import Future
from typing import Any, Generic, ParamSpec, Protocol, Self, TypeVar, overload

import numpy as np

from prefixd.client import state_steps
from prefixd.client.core import ClientCore, StepsOf
from prefixd.client.leases import Lease, RegionUsage, Span
from prefixd.client.results import Loaded, Lookup, Routed, Stored
from prefixd.client.steps import (
    Call,
    Reserve,
    Steps,
    holding,
    released_on_error,
    spans_of,
    unpacked,
)
from prefixd.errors import RegionError
from prefixd.schema.identity import Identity
from prefixd.schema.stored import HotPrefix, ListedBlock
from prefixd.schema.tokens import PromptIds
from prefixd.wire import messages as wire
from prefixd.wire.region import SharedRegion

P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


class Drives(Protocol):
    """A client that runs an operation's steps to its result (Client)."""

    def run(self, steps_of: StepsOf[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...


class Awaits(Protocol):
    """A client whose run of an operation's steps is a coroutine (AsyncClient)."""

    def run(
        self, steps_of: StepsOf[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> Coroutine[Any, Any, T]: ...


class Operation(Generic[P, R]):
    """An operation bound to the client it is read from: `client.run` with its steps function."""

    def __init__(self, steps_of: StepsOf[P, R]) -> None:
        self.steps_of = steps_of
        self.__doc__ = steps_of.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, client: Drives, owner: type[Any]) -> Callable[P, R]: ...
    @overload
    def __get__(self, client: Awaits, owner: type[Any]) -> Callable[P, Coroutine[Any, Any, R]]: ...
    def __get__(self, client: Drives | Awaits | None, owner: type[Any]) -> Any:
        if client is None:
            return self
        return functools.partial(client.run, self.steps_of)


class Background(Generic[P, R]):
    """An operation whose result is a future the work resolves in the background (a
    concurrent.futures one on Client, an asyncio one on AsyncClient)."""

    def __init__(self, steps_of: StepsOf[P, Future[R]]) -> None:
        self.steps_of = steps_of
        self.__doc__ = steps_of.__doc__

    @overload
    def __get__(self, client: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, client: Drives, owner: type[Any]) -> Callable[P, Future[R]]: ...
    @overload
    def __get__(
        self, client: Awaits, owner: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, asyncio.Future[R]]]: ...
    def __get__(self, client: Drives | Awaits | None, owner: type[Any]) -> Any:
        if client is None:
            return self
        run: Callable[..., Any] = functools.partial(client.run, self.steps_of)
        if not inspect.iscoroutinefunction(client.run):
            return run

        async def awaited(*args: P.args, **kwargs: P.kwargs) -> asyncio.Future[R]:
            return asyncio.wrap_future(await run(*args, **kwargs))

        return awaited


# --- the operations -----------------------------------------------------------------------------


def reserve(core: ClientCore, nbytes: int) -> Steps[Lease]:
    """Lease `nbytes` of the region to fill yourself (then `put_spans`), waiting for room."""
    lease: Lease = yield Reserve(core.require_payloads(), nbytes)
    return lease


def put(
    core: ClientCore,
    identity: Identity,
    token_ids: PromptIds,
    payloads: Sequence[Any],
    *,
    first_block: int = 0,
) -> Steps[Stored]:
    """Stage `payloads` in the region and publish blocks first_block.. of `token_ids`."""
    with holding() as held:
        spans = yield from core.stage(payloads, held)
        reply: wire.PutReply = yield from core.prompted_call(
            wire.Put, identity, token_ids, spans_of(held), first_block=first_block, blocks=spans
        )
    return Stored(reply.stored, reply.existed)


def put_spans(
    core: ClientCore,
    identity: Identity,
    token_ids: PromptIds,
    spans: Sequence[tuple[int, int]],
    *,
    first_block: int = 0,
    lease: Lease | None = None,
) -> Steps[Stored]:
    """Publish payloads the engine wrote into leased region space, named by (region offset,
    length) spans; a span outside every held lease is refused (RegionError). Give the `lease`
    they lie in when it may be another client's (one taken before a reconnect): offsets name
    this client's region, where they may lie in another caller's lease, so a span outside
    `lease`, or a lease of another region, is refused."""
    allocator = core.require_payloads()
    region_id = core.region_id(allocator)
    if lease is not None and (lease.allocator is not allocator or lease.released):
        raise RegionError("the lease is not held in this client's region (a reconnect since?)")
    named: list[Span] = []
    for offset, length in spans:
        if (
            lease is not None
            and not lease.offset <= offset <= offset + length <= lease.offset + lease.size
        ):
            raise RegionError(f"[{offset}, {offset + length}) is not inside the lease given")
        span = allocator.covering(offset, length)
        if span is None:
            raise RegionError(
                f"[{offset}, {offset + length}) is not inside a lease this client holds: "
                "reserve() the space and write the payloads there first"
            )
        if span not in named:
            named.append(span)
    reply: wire.PutReply = yield from core.prompted_call(
        wire.Put,
        identity,
        token_ids,
        named,
        owned=False,
        first_block=first_block,
        blocks=[(region_id, o, n) for o, n in spans],
    )
    return Stored(reply.stored, reply.existed)


def lookup(
    core: ClientCore,
    identity: Identity,
    prompts: Sequence[PromptIds],
    *,
    hashes: Sequence[bytes | None] | None = None,
    pin: bool = False,
    prefill_tokens_per_s: float | None = None,
    stored_only: bool = False,
) -> Steps[list[Lookup]]:
    """The stored prefix of each prompt worth loading (one round trip for the whole batch);
    `prefill_tokens_per_s`: the engine's measured prefill throughput, for the benefit rule;
    `stored_only`: what is stored, whether or not loading it pays."""
    reply: wire.LookupReply = yield from core.prompts_call(
        wire.Lookup,
        identity,
        prompts,
        hashes,
        pin=pin or None,
        prefill_tokens_per_s=prefill_tokens_per_s,
        stored_only=stored_only or None,
    )
    return [
        Lookup(
            r.n_blocks,
            r.n_tokens,
            unpacked(r.sizes),
            r.est_load_s,
            r.est_prefill_s,
            r.withheld_tokens,
        )
        for r in reply.results
    ]


def unpin(core: ClientCore, identity: Identity, prompts: Sequence[PromptIds]) -> Steps[int]:
    """Release one of this connection's pins of each closed block of `prompts` (pinned by
    `lookup(..., pin=True)`); how many were released. A lost connection releases them all."""
    reply: wire.UnpinReply = yield from core.prompts_call(wire.Unpin, identity, prompts)
    return reply.released


def delete(core: ClientCore, identity: Identity, prompts: Sequence[PromptIds]) -> Steps[int]:
    """Remove the last closed block of each prompt and every block below it; how many went."""
    reply: wire.DeleteReply = yield from core.prompts_call(wire.Delete, identity, prompts)
    return reply.blocks


def list_blocks(
    core: ClientCore, *, tenant: str, after: bytes | None = None, limit: int = 1024
) -> Steps[tuple[list[ListedBlock], bytes | None]]:
    """A page of the tenant's stored blocks after the cursor `after`, and the next page's
    cursor (None: the listing is complete)."""
    message = wire.ListBlocks(id=core.next_id(), tenant=tenant, after=after, limit=limit)
    reply: wire.ListReply = yield Call(message)
    identities = [w.to_identity() for w in reply.identities]
    blocks = [ListedBlock(identities[b.identity], b.tokens, b.size) for b in reply.blocks]
    return blocks, reply.next


def route(
    core: ClientCore, identity: Identity, token_ids: PromptIds, *, hashes: bytes | None = None
) -> Steps[Routed]:
    """What this node would serve the prompt and its routing score (no payload is read)."""
    reply: wire.RouteReply = yield from core.prompted_call(
        wire.Route, identity, token_ids, hashes=hashes
    )
    return Routed(**{name: getattr(reply, name) for name in Routed.__slots__})


def load(
    core: ClientCore,
    identity: Identity,
    token_ids: PromptIds,
    *,
    length: int | None = None,
    max_blocks: int | None = None,
    hashes: bytes | None = None,
    first_block: int = 0,
    warm: bool = False,
    deadline_s: float | None = None,
) -> Steps[Loaded]:
    """Load the longest stored prefix of `token_ids` (from `first_block` on, at most `length`
    bytes) into leased region space, valid until the result is released. `warm` counts it as
    restart warm-up. Past `deadline_s` (default: the daemon's load_deadline_s) the daemon
    answers the verified prefix it has. With no `length`, a hit whose first block is larger than
    the whole region raises RegionFullError."""
    allocator = core.require_payloads()
    options: dict[str, Any] = {
        "max_blocks": max_blocks,
        "hashes": hashes,
        "first_block": first_block,
        "warm": warm,
        "deadline_s": deadline_s,
    }
    # Into all the free space; when others held space and the hit did not fit, once more with a
    # lease of the hit's size: a load never comes back short for room it could have had.
    lease = yield Reserve.up_to(allocator, length)
    with released_on_error(lease):
        reply = yield from core.load_span(identity, token_ids, lease, 0, lease.size, **options)
    if length is None and reply.next_size and lease.size < allocator.size:
        lease.release()
        [hit] = yield from lookup(
            core, identity, [token_ids], hashes=None if hashes is None else [hashes]
        )
        wanted = hit.sizes[first_block:]
        if max_blocks is not None:
            wanted = wanted[:max_blocks]
        lease = yield Reserve(allocator, min(max(sum(wanted), 1), allocator.size))
        with released_on_error(lease):
            reply = yield from core.load_span(identity, token_ids, lease, 0, lease.size, **options)
    with released_on_error(lease):
        if length is None and not reply.n_blocks and reply.next_size:
            allocator.check_fits(reply.next_size)  # larger than the region: refused, not a miss
        offsets, sizes = unpacked(reply.offsets), unpacked(reply.sizes)
        views = lease.loaded(offsets, sizes)
    return Loaded(reply.n_blocks, reply.n_tokens, offsets, sizes, views, reply.first_block, lease)


def hot(
    core: ClientCore, budget_bytes: int, *, tenant: str, limit: int = 64
) -> Steps[list[HotPrefix[np.ndarray]]]:
    """The tenant's most valuable stored prefixes (by eviction score) within `budget_bytes`."""
    message = wire.Hot(id=core.next_id(), budget_bytes=budget_bytes, tenant=tenant, limit=limit)
    reply: wire.HotReply = yield Call(message)
    return [
        HotPrefix(
            p.identity.to_identity(),
            np.frombuffer(p.tokens, dtype="<u4"),
            unpacked(p.sizes),
            p.score,
        )
        for p in reply.prefixes
    ]


def call(core: ClientCore, message: dict[str, Any]) -> Steps[dict[str, Any]]:
    """Send one protocol message as it is (for operations this client has no call for, or
    tests); the reply, or its error raised as the error's class."""
    reply: dict[str, Any] = yield Call(dict(message))
    return reply


def purge(core: ClientCore, /, *, dry_run: bool = False, **criteria: Any) -> Steps[dict[str, Any]]:
    """Remove entries by tenant, model version or age (see PurgeSelector); the counts."""
    return (yield from call(core, {"op": "purge", "dry_run": dry_run, **criteria}))


def stats(core: ClientCore) -> Steps[dict[str, Any]]:
    return (yield from call(core, {"op": "stats"}))


def health(core: ClientCore) -> Steps[dict[str, Any]]:
    return (yield from call(core, {"op": "health"}))


def verify(core: ClientCore, *, fix: bool = False, payloads: bool = True) -> Steps[dict[str, Any]]:
    """Check (or with `fix`, repair) the store the daemon serves; the report."""
    reply = yield from call(core, {"op": "verify", "fix": fix, "payloads": payloads})
    return {k: v for k, v in reply.items() if k not in ("id", "ok")}


# --- the clients' face ---------------------------------------------------------------------------


class Operations:
    """What `Client` and `AsyncClient` share: every operation, and the core's state."""

    _core: ClientCore

    reserve = Operation(reserve)
    put = Operation(put)
    put_spans = Operation(put_spans)
    lookup = Operation(lookup)
    unpin = Operation(unpin)
    delete = Operation(delete)
    list_blocks = Operation(list_blocks)
    route = Operation(route)
    load = Operation(load)
    hot = Operation(hot)
    put_state = Operation(state_steps.put_state)
    lookup_state = Operation(state_steps.lookup_state)
    load_state = Operation(state_steps.load_state)
    purge = Operation(purge)
    stats = Operation(stats)
    verify = Operation(verify)
    health = Operation(health)
    call = Operation(call)

    def try_reserve(self, nbytes: int) -> Lease | None:
        """Lease `nbytes` of the payload region now, or None when it has no room: for a caller
        that must never wait (an engine's step). Fill it, then `put_spans`."""
        return self._core.require_payloads().try_acquire(nbytes)

    @property
    def socket_path(self) -> os.PathLike[str]:
        return self._core.socket_path

    @property
    def name(self) -> str:
        return self._core.name

    @property
    def timeout(self) -> float:
        return self._core.timeout

    @property
    def server(self) -> dict[str, Any]:
        """The daemon's hello reply (limits, operations, served models, instance)."""
        return self._core.server

    @property
    def region(self) -> SharedRegion | None:
        return self._core.region

    def region_usage(self) -> RegionUsage | None:
        """What the payload region's space is doing (None without a region)."""
        payloads = self._core.payloads
        return None if payloads is None else payloads.usage()
