"""What a request's handler is given: the daemon's shared services (the store and the shared
tier, the worker pools, the limits, the metrics and counters) and its peer, together a
RequestContext; and what a handler is, as the table of prefixd.daemon.operations holds it."""

from __future__ import annotations

import asyncio
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from msgspec import Struct

from prefixd.clock import Clock, SystemClock
from prefixd.daemon.fields import closed_tokens, packed, request_tokens, token_count
from prefixd.daemon.metrics import Metrics
from prefixd.daemon.peer import Peer
from prefixd.daemon.routing import LoadQueue
from prefixd.errors import IdentityError, ProtocolError
from prefixd.schema.identity import Identity
from prefixd.store import PrefixMatch, PurgeSelector, Store
from prefixd.store.purge import PurgeReport
from prefixd.store.results import LoadResult
from prefixd.wire.errors import ErrorCode, code_of
from prefixd.wire.messages import (
    LookupResult,
    Prompts,
    RequestMessage,
    TokenFields,
    WireIdentity,
)

if TYPE_CHECKING:
    from prefixd.cluster.bridge import SharedTierBridge

T = TypeVar("T")
M_co = TypeVar("M_co", bound=RequestMessage, covariant=True)
# A reply: a struct of prefixd.wire.messages, or a map of the same fields (verify's report)
AnyReply = Struct | dict[str, Any]
Query = tuple[bytes | memoryview, bytes | None]  # a prompt's token ids, and its hashes if given

_IDENTITY_CACHE = 1024


class Request(NamedTuple, Generic[M_co]):
    """One decoded request and the descriptors (SCM_RIGHTS) that arrived with its frame."""

    id: int
    message: M_co
    fds: tuple[int, ...] = ()


class Queries(NamedTuple):
    """A request's prompts, read once: the identity they name and each one's tokens and hashes."""

    identity: Identity
    prompts: list[Query]


class Answered(NamedTuple):
    """A reply computed on the event loop, and what to count once it is sent."""

    reply: Struct
    after: Callable[[], None] | None = None


Later = Callable[[], Awaitable[AnyReply]]  # the work of a request a task runs


@dataclass(frozen=True)
class Handler:
    """One request type's handler. `now` answers on the loop what needs no worker, else returns
    the work to run as a task (what it read passed on); `takes_fds`: descriptors with the frame
    are the request's (others are closed); `before_hello`, `while_stopping`: taken before the
    peer said hello, and while the daemon shuts down."""

    run: Callable[[RequestContext, Request[Any]], Awaitable[AnyReply]]
    now: Callable[[RequestContext, Request[Any]], Answered | Later] | None = None
    takes_fds: bool = False
    before_hello: bool = False
    while_stopping: bool = False


@dataclass(kw_only=True)
class Services:
    """What every handler shares: the store (extended by the shared `bridge` tier when one is
    set), the pools store work runs on (verify and purge on `admin_pool`, one at a time, apart
    from lookups and loads), the limits, the metrics and the daemon's counters."""

    store: Store
    pool: Executor
    metrics: Metrics
    max_frame_bytes: int
    max_region_bytes: int
    max_prompt_tokens: int = 4 << 20
    max_request_tokens: int = 16 << 20
    min_reusable_tokens: int = 0
    load_deadline_s: float = 0.0  # 0: loads read until they are done
    models: Mapping[str, str] = field(default_factory=dict)  # served model -> weights fingerprint
    bridge: SharedTierBridge | None = None
    clock: Clock = field(default_factory=SystemClock)  # the store's: one time for the daemon
    admin_pool: Executor | None = None  # None: the pool
    server_counters: Callable[[], dict[str, int]] = dict
    open_connections: Callable[[], int] = int
    ops: list[str] = field(default_factory=list)  # the operations hello names
    verifying: bool = False
    loads: LoadQueue = field(default_factory=LoadQueue)  # what `route` counts as the queue
    # what engines loaded as restart warm-up (`hot` listings, `load` with `warm`)
    warmed: Counter[str] = field(
        default_factory=lambda: Counter(warm_listings=0, warmed_blocks=0, warmed_bytes=0)
    )
    cluster_hits: Counter[str] = field(
        default_factory=lambda: Counter(local_hit_blocks=0, remote_hit_blocks=0)
    )
    # Names this run of the daemon: a client that finds another one after reconnecting knows
    # the old one can no longer touch the region spans its lost requests named.
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    _identities: dict[WireIdentity, Identity] = field(default_factory=dict)

    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.clock.monotonic()

    async def run(self, call: Callable[[], T], pool: Executor | None = None) -> T:
        """Run blocking store work on the pool (or `pool`); store errors become protocol
        errors."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(pool or self.pool, call)
        except Exception as exc:
            raise protocol_error(exc) from None

    def identity(self, wire: WireIdentity) -> Identity:
        """The identity of a wire form; parsed ones are cached by their (frozen, type-checked)
        wire form, so 4.0 or True can never pass for block_tokens 4 or 1."""
        cached = self._identities.get(wire)
        if cached is not None:
            return cached
        try:
            identity = wire.to_identity()
        except IdentityError as exc:
            raise ProtocolError(ErrorCode.BAD_IDENTITY, str(exc)) from None
        if len(self._identities) >= _IDENTITY_CACHE:
            self._identities.clear()
        self._identities[wire] = identity
        return identity

    def deadline(self, asked_s: float | None) -> float | None:
        """When a load that arrives now stops reading (the client's limit, else the daemon's
        load_deadline_s), on the store's clock; None: never."""
        limit_s = asked_s or self.load_deadline_s
        return self.clock.monotonic() + limit_s if limit_s else None

    def longest_prefix(
        self, identity: Identity, tokens: bytes | memoryview, hashes: bytes | None
    ) -> PrefixMatch:
        """The local prefix, extended from the shared tier first when one is configured."""
        match = self.store.longest_prefix(identity, tokens, hashes=hashes)
        if self.bridge is None:
            return match
        remote = self.bridge.read_through(identity, tokens, match.n_blocks, staged=True)
        self.cluster_hits["local_hit_blocks"] += match.n_blocks
        self.cluster_hits["remote_hit_blocks"] += remote
        if remote:  # some may be installed already, the others are staged
            match = self.store.longest_prefix(identity, tokens, hashes=hashes)
        return self.bridge.with_staged(identity, tokens, match)

    def load(
        self, identity: Identity, tokens: bytes | memoryview, out: memoryview, **options: Any
    ) -> LoadResult:
        """`Store.load`, after the prefix is extended from the shared tier when one is set, and
        continued from the blocks it staged (served while their install runs)."""
        if self.bridge is None:
            return self.store.load(identity, tokens, out, **options)
        if not options.get("first_block"):
            self.longest_prefix(identity, tokens, options.get("hashes"))
        return self.bridge.load(identity, tokens, out, **options)

    def purge_everywhere(self, selector: PurgeSelector) -> PurgeReport:
        """Purge the store, then the shared tier's copies of the identities removed whole."""
        if self.bridge is not None:
            self.bridge.settle()  # what read-throughs are installing goes too
        report = self.store.purge(selector)
        if self.bridge is not None and report.digests:
            self.bridge.purged(report.digests)
        return report

    def lookup_results(
        self,
        identity: Identity,
        queries: Sequence[Query],
        matches: Sequence[PrefixMatch | None],
    ) -> tuple[list[LookupResult], list[tuple[int, int, int]]]:
        """The replies of a lookup's prompts, and what to count for each (prompt tokens, hit
        tokens, hit bytes): hits shorter than `min_reusable_tokens` are not offered; each comes
        with the benefit model's estimates."""
        results, observed = [], []
        benefit = self.metrics.benefit
        for (tokens, _), match in zip(queries, matches, strict=True):
            assert match is not None
            offered = match.n_tokens >= self.min_reusable_tokens
            n_tokens = match.n_tokens if offered else 0
            n_bytes = match.payload_bytes if offered else 0
            est_load_s, est_prefill_s = benefit(n_tokens, n_bytes)
            results.append(
                LookupResult(
                    n_blocks=match.n_blocks if offered else 0,
                    n_tokens=n_tokens,
                    sizes=packed(match.payload_sizes) if offered else b"",
                    est_load_s=est_load_s,
                    est_prefill_s=est_prefill_s,
                )
            )
            observed.append((closed_tokens(tokens, identity), n_tokens, n_bytes))
        return results, observed

    def count(self, identity: Identity, observed: list[tuple[int, int, int]]) -> None:
        """Count a lookup's prompts (as lookup_results gave them) in the metrics."""
        for prompt_tokens, hit_tokens, hit_bytes in observed:
            self.metrics.observe_lookup(
                identity.tenant,
                identity.digest,
                prompt_tokens,
                hit_tokens,
                hit_bytes,
                block_tokens=identity.block_tokens,
            )


@dataclass(frozen=True)
class RequestContext:
    """A handler's view of the daemon (`services`) and of the client that asked (`peer`), with
    the checks every request's fields go through."""

    services: Services
    peer: Peer

    def require_tenant(self, tenant: str) -> None:
        """Refuse a tenant the peer's grant (prefixd.daemon.policy) does not name."""
        if not self.peer.grant.may_use(tenant):
            raise ProtocolError(
                ErrorCode.FORBIDDEN, f"uid {self.peer.uid} may not use tenant {tenant!r}"
            )

    def require_op(self, op: str, *, every_tenant: bool = False) -> None:
        """Refuse an administrative operation the peer's grant does not name (and, when it
        reaches every tenant, a peer that may not use every tenant)."""
        grant = self.peer.grant
        if not grant.may_run(op) or (every_tenant and grant.tenants is not None):
            scope = " for every tenant" if every_tenant else ""
            raise ProtocolError(ErrorCode.FORBIDDEN, f"uid {self.peer.uid} may not run {op}{scope}")

    def identity(self, wire: WireIdentity) -> Identity:
        """The identity a request names, if the peer may use its tenant (the tenant policy)."""
        self.require_tenant(wire.tenant)
        return self.services.identity(wire)

    def prompt(self, fields: TokenFields) -> bytes | memoryview:
        """One prompt's packed token ids, within max_prompt_tokens."""
        token_count(fields, self.services.max_prompt_tokens)
        return request_tokens(self.peer, fields)

    def queries(self, msg: Prompts) -> Queries:
        """The prompts of a request that names several, within max_prompt_tokens each and
        max_request_tokens together."""
        identity = self.identity(msg.identity)
        most, total_most = self.services.max_prompt_tokens, self.services.max_request_tokens
        total = sum(
            token_count(prompt, most, f"prompts[{i}].") for i, prompt in enumerate(msg.prompts)
        )
        if total > total_most:
            raise ProtocolError(
                ErrorCode.BAD_TOKENS,
                f"the prompts hold {total} token ids together, at most {total_most} "
                "per request (max_request_tokens)",
            )
        prompts = [
            (request_tokens(self.peer, prompt, f"prompts[{i}]."), prompt.hashes)
            for i, prompt in enumerate(msg.prompts)
        ]
        return Queries(identity, prompts)


def on_loop(call: Callable[[], T]) -> T:
    """Store work that memory answers, run on the event loop; its errors mapped as `run` maps
    those of the pool."""
    try:
        return call()
    except Exception as exc:
        raise protocol_error(exc) from None


def protocol_error(exc: Exception) -> Exception:
    """A store error as the protocol error a client gets (prefixd.wire.errors.code_of); anything
    else, or an error of prefixd's that says `internal`, unchanged (the server logs it)."""
    if isinstance(exc, ProtocolError):
        return exc
    code = code_of(exc)
    if code is None or code is ErrorCode.INTERNAL:
        return exc
    return ProtocolError(code, str(exc))
