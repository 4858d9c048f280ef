"""What each protocol operation does. Requests arrive decoded and type-checked against their
schema (prefixd.wire.messages); handlers check what the schema cannot say (a span inside its
region, token ids agreeing with `n_tokens`, ...), then run store work on the bounded thread pool
so the event loop never blocks on disk, checksums or zstd."""

from __future__ import annotations

import array
import asyncio
import dataclasses
import secrets
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from msgspec import Struct

from prefixd import __version__
from prefixd.clock import Clock, SystemClock
from prefixd.daemon import engine_ops, routing, state_ops
from prefixd.daemon.fields import closed_tokens, region_output, request_tokens
from prefixd.daemon.metrics import Metrics
from prefixd.daemon.routing import LoadQueue
from prefixd.errors import ConfigError, IdentityError, ProtocolError
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TOKEN_BYTES
from prefixd.store import PrefixMatch, PurgeSelector, Store
from prefixd.store import check_report
from prefixd.store.purge import PurgeReport
from prefixd.store.results import LoadResult
from prefixd.wire.errors import ErrorCode, code_of
from prefixd.wire.frames import PROTOCOL_VERSION
from prefixd.wire.messages import (
    Attach,
    AttachReply,
    Delete,
    Health,
    HealthReply,
    Hello,
    HelloReply,
    Hot,
    HotEntry,
    HotReply,
    Load,
    LoadReply,
    Lookup,
    LookupReply,
    LookupResult,
    LookupState,
    Purge,
    PurgeReply,
    Put,
    PutReply,
    RequestMessage,
    Route,
    RouteReply,
    Span,
    Stats,
    StatsReply,
    TokenFields,
    Unpin,
    Verify,
    WireIdentity,
)
from prefixd.wire.region import MappedRegion

if TYPE_CHECKING:
    from prefixd.cluster.bridge import SharedTierBridge
    from prefixd.daemon.connection import Connection

T = TypeVar("T")
M_co = TypeVar("M_co", bound=RequestMessage, covariant=True)
# A reply: a struct of prefixd.wire.messages, or a map of the same fields (verify's report)
AnyReply = Struct | dict[str, Any]
Handler = Callable[["Connection", "Request[Any]"], Awaitable[AnyReply]]

_IDENTITY_CACHE = 1024
MAX_REGIONS_PER_CONNECTION = 16
DEFAULT_HOT_LIMIT = 64


class Request(NamedTuple, Generic[M_co]):
    """One decoded request and the descriptors (SCM_RIGHTS) that arrived with its frame."""

    id: int
    message: M_co
    fds: tuple[int, ...] = ()


class Operations:
    """The daemon's operations, by name. Only `attach` takes descriptors; the server closes the
    descriptors of every other request."""

    def __init__(
        self,
        store: Store,
        pool: Executor,
        *,
        max_frame_bytes: int,
        max_region_bytes: int,
        max_prompt_tokens: int = 4 << 20,
        max_request_tokens: int = 16 << 20,
        models: Mapping[str, str] | None = None,
        metrics: Metrics | None = None,
        min_reusable_tokens: int = 0,
        bridge: SharedTierBridge | None = None,
        clock: Clock | None = None,
        admin_pool: Executor | None = None,
        load_deadline_s: float = 0.0,
    ) -> None:
        self.store = store
        self.clock: Clock = clock or SystemClock()  # the store's: one time for the daemon
        self.bridge = bridge  # the shared tier, when one is configured
        self.metrics = metrics if metrics is not None else Metrics(store, prefill_tokens_per_s=1e4)
        self.min_reusable_tokens = min_reusable_tokens
        self.load_deadline_s = load_deadline_s  # 0: loads read until they are done
        self.models = models if models is not None else {}  # served model -> weights fingerprint
        self.pool = pool
        # verify runs here, one at a time, apart from the pool that serves lookups and loads
        self.admin_pool = admin_pool if admin_pool is not None else pool
        self._verifying = False
        self.max_frame_bytes = max_frame_bytes
        self.max_region_bytes = max_region_bytes
        self.max_prompt_tokens = max_prompt_tokens
        self.max_request_tokens = max_request_tokens
        self.started = self.clock.monotonic()
        # Names this run of the daemon: a client that finds another one after reconnecting knows
        # the old one can no longer touch the region spans its lost requests named.
        self.instance = secrets.token_hex(8)
        self._identities: dict[WireIdentity, Identity] = {}
        self.takes_fds = frozenset({"attach"})
        self.handlers: dict[str, Handler] = {
            "hello": self.hello,
            "attach": self.attach,
            "put": self.put,
            "lookup": self.lookup,
            "load": self.load,
            "stats": self.stats,
            "health": self.health,
            "purge": self.purge,
            "put_state": partial(state_ops.put_state, self),
            "lookup_state": partial(state_ops.lookup_state, self),
            "load_state": partial(state_ops.load_state, self),
            "hot": self.hot,
            "verify": self.verify,
            "route": self.route,
            "unpin": partial(engine_ops.unpin, self),
            "delete": partial(engine_ops.delete, self),
            "list": partial(engine_ops.list_blocks, self),
        }
        self.loads = LoadQueue()  # what `route` counts as this node's queue
        # what engines loaded as restart warm-up (`hot` listings, `load` with `warm`)
        self.warmed: Counter[str] = Counter(warm_listings=0, warmed_blocks=0, warmed_bytes=0)
        self.cluster_hits: Counter[str] = Counter(local_hit_blocks=0, remote_hit_blocks=0)

    async def hello(self, conn: Connection, request: Request[Hello]) -> HelloReply:
        msg = request.message
        _check_protocol(msg)
        retired = 0
        if msg.serves:
            _may_run(conn, "retire", every_tenant=True)  # retiring touches every tenant
        for served in msg.serves or ():
            # the engine serves these weights now: other versions of the model are stale
            selector = PurgeSelector(model=served.model, keep={"weights": served.weights})
            retired += (await self._run(partial(self.purge_everywhere, selector))).blocks
        return self._greet(conn, request.id, retired)

    def hello_now(self, conn: Connection, request: Request[Hello]) -> HelloReply:
        """A hello that serves no models (so retires nothing), answered on the event loop."""
        assert not request.message.serves
        _check_protocol(request.message)
        return self._greet(conn, request.id, 0)

    def _greet(self, conn: Connection, rid: int, retired: int) -> HelloReply:
        conn.greeted = True
        return HelloReply(
            id=rid,
            protocol=PROTOCOL_VERSION,
            server=f"prefixd/{__version__}",
            ops=sorted(self.handlers),
            max_frame_bytes=self.max_frame_bytes,
            max_region_bytes=self.max_region_bytes,
            max_inflight=conn.max_inflight,
            models=dict(self.models),
            retired=retired,
            instance=self.instance,
        )

    async def attach(self, conn: Connection, request: Request[Attach]) -> AttachReply:
        rid, size = request.id, request.message.size
        fds = list(request.fds)
        try:
            if size > self.max_region_bytes:
                raise ProtocolError(
                    ErrorCode.BAD_REQUEST, f"attach: size must be in [1, {self.max_region_bytes}]"
                )
            if len(fds) != 1:
                raise ProtocolError(
                    ErrorCode.BAD_REGION,
                    f"attach needs exactly one memfd sent with its frame, got {len(fds)}",
                )
            if len(conn.regions) >= MAX_REGIONS_PER_CONNECTION:
                raise ProtocolError(
                    ErrorCode.BAD_REGION,
                    f"at most {MAX_REGIONS_PER_CONNECTION} regions per connection",
                )
            fd = fds.pop()
        finally:
            conn.close_fds(fds)
        region = await self._run(partial(MappedRegion, fd, size, self.max_region_bytes))
        try:  # mapped in now, not page by page in the first load; off the workers and the loop
            await asyncio.get_running_loop().run_in_executor(None, region.populate)
        except BaseException:
            region.close()
            raise
        return AttachReply(id=rid, region=conn.add_region(region), size=size)

    async def put(self, conn: Connection, request: Request[Put]) -> PutReply:
        rid, msg = request.id, request.message
        identity = self._identity(conn, msg.identity)
        tokens = self._prompt(conn, msg)
        first_block = msg.first_block or 0
        views = [conn.span(span) for span in msg.blocks]
        result = await self._run(
            partial(self.store.put, identity, tokens, views, first_block=first_block)
        )
        if self.bridge is not None and result.stored:
            self.bridge.published(identity, result.hashes[len(result.hashes) - result.stored :])
        self.metrics.observe_put(
            identity.tenant,
            identity.digest,
            result.stored,
            len(views) * identity.block_tokens,
            sum(len(v) for v in views),
        )
        return PutReply(id=rid, stored=result.stored, existed=result.existed)

    def lookup_from_memory(
        self, conn: Connection, request: Request[Lookup]
    ) -> tuple[LookupReply, Callable[[], None]] | None:
        """The lookup's reply if memory alone answers every prompt (see Store.cached_prefix),
        computed at once on the event loop, and the counting to do once it is sent; None sends
        the request the usual way (and a lookup that pins always goes that way)."""
        if request.message.pin:
            return None
        identity, queries = self._lookup_queries(conn, request.message)
        if sum(len(tokens) for tokens, _ in queries) > LOOP_TOKEN_BYTES:
            return None  # comparing that many token ids is work for a worker, not for the loop
        try:
            cached = self.store.cached_prefixes(identity, queries)
        except Exception as exc:
            raise _protocol_error(exc) from None
        if cached is None:
            return None
        matches: list[PrefixMatch | None] = list(cached)
        results, observed = self._lookup_results(identity, queries, matches)
        reply = LookupReply(id=request.id, results=results)
        return reply, partial(self._count, identity, observed)

    def _lookup_queries(
        self, conn: Connection, msg: Lookup | LookupState | Unpin | Delete
    ) -> tuple[Identity, list[tuple[bytes | memoryview, bytes | None]]]:
        identity = self._identity(conn, msg.identity)
        total = sum(
            self._token_count(prompt, f"prompts[{i}].") for i, prompt in enumerate(msg.prompts)
        )
        if total > self.max_request_tokens:
            raise ProtocolError(
                ErrorCode.BAD_TOKENS,
                f"the prompts hold {total} token ids together, at most {self.max_request_tokens} "
                "per request (max_request_tokens)",
            )
        queries = [
            (request_tokens(conn, prompt, f"prompts[{i}]."), prompt.hashes)
            for i, prompt in enumerate(msg.prompts)
        ]
        return identity, queries

    def _token_count(self, fields: TokenFields, where: str = "") -> int:
        """How many token ids a prompt names, refused past max_prompt_tokens before any of them
        is read, mapped or hashed."""
        span: Span | None = fields.tokens_span
        count = span[2] if span is not None else len(fields.tokens or b"") // TOKEN_BYTES
        if count > self.max_prompt_tokens:
            raise ProtocolError(
                ErrorCode.BAD_TOKENS,
                f"{where}tokens: {count} token ids, at most {self.max_prompt_tokens} per prompt "
                "(max_prompt_tokens)",
            )
        return count

    def _prompt(self, conn: Connection, fields: TokenFields) -> bytes | memoryview:
        """One prompt's packed token ids, within max_prompt_tokens."""
        self._token_count(fields)
        return request_tokens(conn, fields)

    async def lookup(self, conn: Connection, request: Request[Lookup]) -> LookupReply:
        rid = request.id
        identity, queries = self._lookup_queries(conn, request.message)
        if request.message.pin:
            return await engine_ops.pinned_lookup(self, conn, rid, identity, queries)

        # Prompts whose whole prefix was verified recently are answered here, without a thread
        # hop (the store reads no record for them); the rest go to the pool.
        try:
            matches: list[PrefixMatch | None] = [
                self.store.cached_prefix(identity, tokens, hashes=hashes)
                for tokens, hashes in queries
            ]
        except Exception as exc:  # not run through _run: map store errors the same way
            raise _protocol_error(exc) from None
        missing = [i for i, match in enumerate(matches) if match is None]
        if missing:

            def run() -> list[PrefixMatch]:
                return [self._longest_prefix(identity, *queries[i]) for i in missing]

            for i, match in zip(missing, await self._run(run)):
                matches[i] = match
        results, observed = self._lookup_results(identity, queries, matches)
        self._count(identity, observed)
        return LookupReply(id=rid, results=results)

    def _longest_prefix(
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

    def _load(
        self, identity: Identity, tokens: bytes | memoryview, out: memoryview, **options: Any
    ) -> LoadResult:
        """`Store.load`, after the prefix is extended from the shared tier when one is set, and
        continued from the blocks it staged (served while their install runs)."""
        if self.bridge is None:
            return self.store.load(identity, tokens, out, **options)
        if not options.get("first_block"):
            self._longest_prefix(identity, tokens, options.get("hashes"))
        return self.bridge.load(identity, tokens, out, **options)

    def purge_everywhere(self, selector: PurgeSelector) -> PurgeReport:
        """Purge the store, then the shared tier's copies of the identities removed whole."""
        if self.bridge is not None:
            self.bridge.settle()  # what read-throughs are installing goes too
        report = self.store.purge(selector)
        if self.bridge is not None and report.digests:
            self.bridge.purged(report.digests)
        return report

    def _lookup_results(
        self,
        identity: Identity,
        queries: Sequence[tuple[bytes | memoryview, bytes | None]],
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
                    sizes=_packed(match.payload_sizes) if offered else b"",
                    est_load_s=est_load_s,
                    est_prefill_s=est_prefill_s,
                )
            )
            observed.append((closed_tokens(tokens, identity), n_tokens, n_bytes))
        return results, observed

    def _count(self, identity: Identity, observed: list[tuple[int, int, int]]) -> None:
        for prompt_tokens, hit_tokens, hit_bytes in observed:
            self.metrics.observe_lookup(
                identity.tenant,
                identity.digest,
                prompt_tokens,
                hit_tokens,
                hit_bytes,
                block_tokens=identity.block_tokens,
            )

    async def load(self, conn: Connection, request: Request[Load]) -> LoadReply:
        rid, msg = request.id, request.message
        identity = self._identity(conn, msg.identity)
        tokens = self._prompt(conn, msg)
        offset, out = region_output(conn, msg)
        first_block = msg.first_block or 0
        started = time.perf_counter()
        deadline = self._deadline(msg.deadline_s)
        self.loads.started()
        result = LoadResult(0, 0, (), ())
        try:
            result = await self._run(
                partial(
                    self._load,
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
            self.loads.finished(sum(result.sizes))
        if not first_block and result.n_tokens < self.min_reusable_tokens:
            result = LoadResult(0, 0, (), ())  # too short to be worth it: not offered
        if msg.warm:
            self.warmed["warmed_blocks"] += result.n_blocks
            self.warmed["warmed_bytes"] += sum(result.sizes)
        self.metrics.observe_load(
            identity.tenant,
            result.n_blocks * identity.block_tokens,
            sum(result.sizes),
            time.perf_counter() - started,
        )
        return LoadReply(
            id=rid,
            n_blocks=result.n_blocks,
            n_tokens=result.n_tokens,
            offsets=_packed([offset + o for o in result.offsets]),
            sizes=_packed(result.sizes),
            first_block=result.first_block,
            next_size=result.next_size,
        )

    async def route(self, conn: Connection, request: Request[Route]) -> RouteReply:
        """What this node would serve the prompt, and its score (prefixd.daemon.routing)."""
        msg = request.message
        identity = self._identity(conn, msg.identity)
        tokens = self._prompt(conn, msg)
        match = None
        if len(tokens) <= LOOP_TOKEN_BYTES:  # as lookups: short prompts from memory, on the loop
            try:
                match = self.store.cached_prefix(identity, tokens, hashes=msg.hashes)
            except Exception as exc:
                raise _protocol_error(exc) from None
        if match is None:
            match = await self._run(partial(self._longest_prefix, identity, tokens, msg.hashes))
        [result], _ = self._lookup_results(identity, [(tokens, msg.hashes)], [match])
        return routing.answer(
            request.id,
            result.n_blocks,
            result.n_tokens,
            match.payload_bytes if result.n_blocks else 0,
            load_time=self.metrics.load_time,
            prefill_tokens_per_s=self.metrics.prefill_tokens_per_s,
            queue=self.loads,
        )

    async def hot(self, conn: Connection, request: Request[Hot]) -> HotReply:
        """A tenant's most valuable prefixes to warm after a restart, whole, within a byte
        budget; the reply holds at most half a frame of token ids (the rest are left out)."""
        rid, msg = request.id, request.message
        _may_run(conn, "hot")
        _may_use(conn, msg.tenant)
        limit = DEFAULT_HOT_LIMIT if msg.limit is None else msg.limit  # at most MAX_HOT_PREFIXES
        found = await self._run(
            partial(self.store.hottest, msg.budget_bytes, tenant=msg.tenant, limit=limit)
        )
        room = self.max_frame_bytes // 2
        prefixes = []
        for prefix in found:
            room -= len(prefix.tokens) + 1024
            if room < 0:
                break
            prefixes.append(
                HotEntry(
                    identity=WireIdentity.of(prefix.identity),
                    tokens=prefix.tokens,
                    sizes=_packed(prefix.payload_sizes),
                    score=prefix.score,
                )
            )
        self.warmed["warm_listings"] += 1
        return HotReply(id=rid, prefixes=prefixes)

    async def purge(self, conn: Connection, request: Request[Purge]) -> PurgeReply:
        rid, msg = request.id, request.message
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
        _may_run(conn, "purge", every_tenant=msg.tenant is None)
        if msg.tenant is not None:
            _may_use(conn, msg.tenant)
        # on the administrative thread, queued one at a time: never on the workers that serve
        # lookups and loads, however many purges a peer pipelines
        if msg.dry_run:
            call = partial(self.store.purge, selector, dry_run=True)
        else:
            call = partial(self.purge_everywhere, selector)
        report = await self._run(call, self.admin_pool)
        return PurgeReply(
            id=rid,
            identities=report.identities,
            blocks=report.blocks,
            payload_bytes=report.payload_bytes,
            stored_bytes=report.stored_bytes,
            dry_run=report.dry_run,
            seconds=report.seconds,
            unknown=list(report.unknown),
        )

    async def verify(self, conn: Connection, request: Request[Verify]) -> dict[str, Any]:
        """Check the store while serving (a read snapshot; writers go on), or repair it (one
        write transaction: other writes wait for it, reads do not). The reply is the report
        `prefixd verify` prints, as a map (its two forms: prefixd.wire.messages.VerifyReply)."""
        rid, msg = request.id, request.message
        _may_run(conn, "verify")
        fix = bool(msg.fix)
        payloads = msg.payloads is not False

        def run() -> dict[str, Any]:
            return check_report.verify(self.store, fix=fix, payloads=payloads)

        if self._verifying:
            raise ProtocolError(
                ErrorCode.BUSY, "a verify is already running: ask again when it is done"
            )
        self._verifying = True
        try:
            return {"id": rid, "ok": True, **await self._run(run, self.admin_pool)}
        finally:
            self._verifying = False

    async def stats(self, conn: Connection, request: Request[Stats]) -> StatsReply:
        rid = request.id
        stats = await self._run(self.store.stats)
        metrics = await self._run(self.metrics.snapshot)
        if self.bridge is not None:
            metrics["cluster"] = {**self.bridge.snapshot(), **self.cluster_hits}
        server = {**conn.server.counters(), **self.warmed, "models": dict(self.models)}
        return StatsReply(id=rid, store=dataclasses.asdict(stats), server=server, metrics=metrics)

    async def health(self, conn: Connection, request: Request[Health]) -> HealthReply:
        rid = request.id
        await self._run(self.store.stats)  # the store answers through the pool
        return HealthReply(
            id=rid,
            # a failed fsync: writes refused, reads served (prefixd.store.sync_state)
            status="ok" if self.store.sync_failure is None else "sync_failed",
            uptime_s=round(self.clock.monotonic() - self.started, 3),
            connections=conn.server.open_connections,
            data_dir=str(self.store.path),
        )

    # --- helpers --------------------------------------------------------------------------------

    def _deadline(self, asked_s: float | None) -> float | None:
        """When a load that arrives now stops reading (the client's limit, else the daemon's
        load_deadline_s), on the store's clock; None: never."""
        limit_s = asked_s or self.load_deadline_s
        return self.clock.monotonic() + limit_s if limit_s else None

    async def _run(self, call: Callable[[], T], pool: Executor | None = None) -> T:
        """Run blocking store work on the pool (or `pool`); store errors become protocol
        errors."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(pool or self.pool, call)
        except Exception as exc:
            raise _protocol_error(exc) from None

    def _identity(self, conn: Connection, wire: WireIdentity) -> Identity:
        """The identity a request names, if the peer may use its tenant (the tenant policy);
        parsed ones are cached by their (frozen, type-checked) wire form, so 4.0 or True can
        never pass for block_tokens 4 or 1."""
        _may_use(conn, wire.tenant)
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


# The most token bytes a lookup may hold to be answered from memory on the event loop: comparing
# them costs tens of microseconds; anything longer goes to a worker like every other request.
LOOP_TOKEN_BYTES = 512 << 10


def _check_protocol(msg: Hello) -> None:
    if msg.protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_VERSION,
            f"client speaks protocol {msg.protocol}, this daemon speaks {PROTOCOL_VERSION}",
        )


def _may_use(conn: Connection, tenant: str) -> None:
    """Refuse a tenant the peer's grant (prefixd.config.policy) does not name."""
    if not conn.grant.may_use(tenant):
        raise ProtocolError(ErrorCode.FORBIDDEN, f"uid {conn.uid} may not use tenant {tenant!r}")


def _may_run(conn: Connection, op: str, *, every_tenant: bool = False) -> None:
    """Refuse an administrative operation the peer's grant does not name (and, when it reaches
    every tenant, a peer that may not use every tenant)."""
    grant = conn.grant
    if not grant.may_run(op) or (every_tenant and grant.tenants is not None):
        scope = " for every tenant" if every_tenant else ""
        raise ProtocolError(ErrorCode.FORBIDDEN, f"uid {conn.uid} may not run {op}{scope}")


def _protocol_error(exc: Exception) -> Exception:
    """A store error as the protocol error a client gets (prefixd.wire.errors.code_of); anything
    else, or an error of prefixd's that says `internal`, unchanged (the server logs it)."""
    if isinstance(exc, ProtocolError):
        return exc
    code = code_of(exc)
    if code is None or code is ErrorCode.INTERNAL:
        return exc
    return ProtocolError(code, str(exc))


def _packed(values: Sequence[int]) -> bytes:
    """Little-endian uint64s (array.array packs a lookup's sizes three times quicker than numpy)."""
    packed = array.array("Q", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


__all__ = ["MAX_REGIONS_PER_CONNECTION", "Operations", "Request"]
