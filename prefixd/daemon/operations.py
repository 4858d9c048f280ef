"""What each protocol operation does. Handlers validate every field, then run store work on the
bounded thread pool so the event loop never blocks on disk, checksums or zstd."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np

from prefixd import __version__
from prefixd.daemon.metrics import Metrics
from prefixd.errors import (
    BlockCollisionError,
    ConfigError,
    CorruptStoreError,
    DestinationError,
    IdentityError,
    OpenTailError,
    OrphanBlockError,
    PayloadError,
    ProtocolError,
    StoreFullError,
    StoreWriteError,
    TokenError,
)
from prefixd.schema.identity import Identity
from prefixd.schema.tokens import TOKEN_BYTES
from prefixd.store import PrefixMatch, PurgeSelector, Store
from prefixd.store.checker import run_check
from prefixd.store.joint import JointMatch
from prefixd.store.purge import PurgeReport
from prefixd.store.results import LoadResult, RepairReport
from prefixd.store.verify import verify_report
from prefixd.wire.errors import ErrorCode
from prefixd.wire.frames import (
    PROTOCOL_VERSION,
    field,
    int_field,
    ok_reply,
)
from prefixd.wire.region import MappedRegion

if TYPE_CHECKING:
    from prefixd.cluster.bridge import SharedTierBridge
    from prefixd.daemon.server import Connection

T = TypeVar("T")
Handler = Callable[["Connection", "Request"], Awaitable[dict[str, Any]]]

_STORE_ERRORS: tuple[tuple[type[Exception], ErrorCode], ...] = (
    (OpenTailError, ErrorCode.OPEN_TAIL),
    (OrphanBlockError, ErrorCode.ORPHAN),
    (BlockCollisionError, ErrorCode.COLLISION),
    (PayloadError, ErrorCode.BAD_PAYLOAD),
    (DestinationError, ErrorCode.BAD_REGION),
    (TokenError, ErrorCode.BAD_TOKENS),
    (IdentityError, ErrorCode.BAD_IDENTITY),
    (StoreFullError, ErrorCode.STORE_FULL),
    (StoreWriteError, ErrorCode.WRITE_FAILED),
    (CorruptStoreError, ErrorCode.STORE_DAMAGED),
)
_IDENTITY_CACHE = 1024
MAX_REGIONS_PER_CONNECTION = 16
MAX_PROMPTS_PER_LOOKUP = 4096
MAX_BLOCKS_PER_PUT = 1 << 16
MAX_HOT_PREFIXES = 4096
PURGE_FIELDS = ("tenant", "model", "keep", "older_than_s", "everything")


class Request(NamedTuple):
    """One decoded request and the descriptors (SCM_RIGHTS) that arrived with its frame."""

    id: int
    message: dict[str, Any]
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
        models: Mapping[str, str] | None = None,
        metrics: Metrics | None = None,
        min_reusable_tokens: int = 0,
        bridge: SharedTierBridge | None = None,
    ) -> None:
        self.store = store
        self.bridge = bridge  # the shared tier, when one is configured
        self.metrics = metrics if metrics is not None else Metrics(store, prefill_tokens_per_s=1e4)
        self.min_reusable_tokens = min_reusable_tokens
        self.models = models if models is not None else {}  # served model -> weights fingerprint
        self.pool = pool
        self.max_frame_bytes = max_frame_bytes
        self.max_region_bytes = max_region_bytes
        self.started = time.monotonic()
        # Names this run of the daemon: a client that finds another one after reconnecting knows
        # the old one can no longer touch the region spans its lost requests named.
        self.instance = secrets.token_hex(8)
        self._identities: dict[tuple[tuple[str, Any], ...], Identity] = {}
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
            "put_state": self.put_state,
            "lookup_state": self.lookup_state,
            "load_state": self.load_state,
            "hot": self.hot,
            "verify": self.verify,
        }
        # what engines loaded as restart warm-up (`hot` listings, `load` with `warm`)
        self.warmed: Counter[str] = Counter(warm_listings=0, warmed_blocks=0, warmed_bytes=0)
        self.cluster_hits: Counter[str] = Counter(local_hit_blocks=0, remote_hit_blocks=0)

    async def hello(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid, msg = request.id, request.message
        version = int_field(msg, "protocol", high=1 << 31)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_VERSION,
                f"client speaks protocol {version}, this daemon speaks {PROTOCOL_VERSION}",
            )
        serves = _served_versions(msg)
        retired = 0
        for model, weights in serves:
            # the engine serves these weights now: other versions of the model are stale
            selector = PurgeSelector(model=model, keep={"weights": weights})
            retired += (await self._run(partial(self.purge_everywhere, selector))).blocks
        conn.greeted = True
        return ok_reply(
            rid,
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

    async def attach(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid, msg = request.id, request.message
        fds = list(request.fds)
        try:
            size = int_field(msg, "size", low=1, high=self.max_region_bytes)
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
        return ok_reply(rid, region=conn.add_region(region), size=size)

    async def put(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid, msg = request.id, request.message
        identity = self._identity(msg)
        tokens = _tokens(conn, msg)
        first_block = int_field(msg, "first_block", default=0)
        spans = field(msg, "blocks", list)
        if len(spans) > MAX_BLOCKS_PER_PUT:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"at most {MAX_BLOCKS_PER_PUT} blocks per put"
            )
        views = [conn.span(_span(span, f"blocks[{i}]")) for i, span in enumerate(spans)]
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
        return ok_reply(rid, stored=result.stored, existed=result.existed)

    def lookup_from_memory(
        self, conn: Connection, request: Request
    ) -> tuple[dict[str, Any], Callable[[], None]] | None:
        """The lookup's reply if memory alone answers every prompt (see Store.cached_prefix),
        computed at once on the event loop, and the counting to do once it is sent; None sends
        the request the usual way."""
        identity, queries = self._lookup_queries(conn, request.message)
        try:
            matches = [
                self.store.cached_prefix(identity, tokens, hashes=hashes)
                for tokens, hashes in queries
            ]
        except Exception as exc:
            raise _protocol_error(exc) from None
        if any(m is None for m in matches):
            return None
        results, observed = self._lookup_results(identity, queries, matches)
        return ok_reply(request.id, results=results), partial(self._count, identity, observed)

    def _lookup_queries(
        self, conn: Connection, msg: Mapping[str, Any]
    ) -> tuple[Identity, list[tuple[bytes | memoryview, bytes | None]]]:
        identity = self._identity(msg)
        prompts = field(msg, "prompts", list)
        if len(prompts) > MAX_PROMPTS_PER_LOOKUP:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"at most {MAX_PROMPTS_PER_LOOKUP} prompts per lookup"
            )
        queries = []
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, dict):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"prompts[{i}] must be a map")
            queries.append((_tokens(conn, prompt, f"prompts[{i}]."), _hashes(prompt)))
        return identity, queries

    async def lookup(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid = request.id
        identity, queries = self._lookup_queries(conn, request.message)

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
        return ok_reply(rid, results=results)

    def _longest_prefix(
        self, identity: Identity, tokens: bytes | memoryview, hashes: bytes | None
    ) -> PrefixMatch:
        """The local prefix, extended from the shared tier first when one is configured."""
        match = self.store.longest_prefix(identity, tokens, hashes=hashes)
        if self.bridge is None:
            return match
        remote = self.bridge.read_through(identity, tokens, match.n_blocks)
        self.cluster_hits["local_hit_blocks"] += match.n_blocks
        self.cluster_hits["remote_hit_blocks"] += remote
        return self.store.longest_prefix(identity, tokens, hashes=hashes) if remote else match

    def _load(
        self, identity: Identity, tokens: bytes | memoryview, out: memoryview, **options: Any
    ) -> LoadResult:
        """`Store.load`, after the prefix is extended from the shared tier when one is set."""
        if self.bridge is not None and not options.get("first_block"):
            self._longest_prefix(identity, tokens, options.get("hashes"))
        return self.store.load(identity, tokens, out, **options)

    def purge_everywhere(self, selector: PurgeSelector) -> PurgeReport:
        """Purge the store, then the shared tier's copies of the identities removed whole."""
        report = self.store.purge(selector)
        if self.bridge is not None and report.digests:
            self.bridge.purged(report.digests)
        return report

    def _lookup_results(
        self,
        identity: Identity,
        queries: Sequence[tuple[bytes | memoryview, bytes | None]],
        matches: Sequence[PrefixMatch | None],
    ) -> tuple[list[dict[str, Any]], list[tuple[int, int, int]]]:
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
            result = _lookup_result(match) if offered else dict(_NO_HIT)
            result["est_load_s"], result["est_prefill_s"] = benefit(n_tokens, n_bytes)
            results.append(result)
            observed.append((_closed_tokens(tokens, identity), n_tokens, n_bytes))
        return results, observed

    def _count(self, identity: Identity, observed: list[tuple[int, int, int]]) -> None:
        for prompt_tokens, hit_tokens, hit_bytes in observed:
            self.metrics.observe_lookup(
                identity.tenant, identity.digest, prompt_tokens, hit_tokens, hit_bytes
            )

    async def load(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid, msg = request.id, request.message
        identity = self._identity(msg)
        tokens = _tokens(conn, msg)
        hashes = _hashes(msg)
        offset, out = _output(conn, msg)
        max_blocks = int_field(msg, "max_blocks", default=None)
        first_block = int_field(msg, "first_block", default=0)
        warm = field(msg, "warm", bool, default=False)
        started = time.perf_counter()
        result = await self._run(
            partial(
                self._load,
                identity,
                tokens,
                out,
                max_blocks=max_blocks,
                hashes=hashes,
                first_block=first_block,
            )
        )
        if not first_block and result.n_tokens < self.min_reusable_tokens:
            result = LoadResult(0, 0, (), ())  # too short to be worth it: not offered
        if warm:
            self.warmed["warmed_blocks"] += result.n_blocks
            self.warmed["warmed_bytes"] += sum(result.sizes)
        self.metrics.observe_load(
            identity.tenant,
            result.n_blocks * identity.block_tokens,
            sum(result.sizes),
            time.perf_counter() - started,
        )
        return ok_reply(
            rid,
            n_blocks=result.n_blocks,
            n_tokens=result.n_tokens,
            offsets=_packed([offset + o for o in result.offsets]),
            sizes=_packed(result.sizes),
            first_block=result.first_block,
        )

    async def hot(self, conn: Connection, request: Request) -> dict[str, Any]:
        """A tenant's most valuable prefixes to warm after a restart, whole, within a byte
        budget; the reply holds at most half a frame of token ids (the rest are left out)."""
        rid, msg = request.id, request.message
        budget = int_field(msg, "budget_bytes", high=1 << 62)
        limit = int_field(msg, "limit", default=64, low=1, high=MAX_HOT_PREFIXES)
        tenant = field(msg, "tenant", str, code=ErrorCode.BAD_IDENTITY)
        found = await self._run(partial(self.store.hottest, budget, tenant=tenant, limit=limit))
        room = self.max_frame_bytes // 2
        prefixes = []
        for prefix in found:
            room -= len(prefix.tokens) + 1024
            if room < 0:
                break
            prefixes.append(
                {
                    "identity": prefix.identity.to_dict(),
                    "tokens": prefix.tokens,
                    "sizes": _packed(prefix.payload_sizes),
                    "score": prefix.score,
                }
            )
        self.warmed["warm_listings"] += 1
        return ok_reply(rid, prefixes=prefixes)

    # --- hybrid identities: state groups (prefixd.schema.state) ---------------------------------

    async def put_state(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid, msg = request.id, request.message
        identity = self._identity(msg)
        tokens = _tokens(conn, msg)
        first_block = int_field(msg, "first_block", default=0)
        upto_tokens = int_field(msg, "upto_tokens", default=None)
        paged_spans = field(msg, "paged", dict, default={})
        checkpoint_spans = field(msg, "checkpoints", dict, default={})
        lists = (*paged_spans.values(), *checkpoint_spans.values())
        count = sum(len(v) for v in lists if isinstance(v, list))
        if count > MAX_BLOCKS_PER_PUT:
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"at most {MAX_BLOCKS_PER_PUT} payloads per put"
            )
        paged: dict[str, list[memoryview]] = {}
        for name, spans in paged_spans.items():
            where = f"paged[{name!r}]"
            if not isinstance(name, str) or not isinstance(spans, list):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where} must map a name to spans")
            paged[name] = [conn.span(_span(s, f"{where}[{i}]")) for i, s in enumerate(spans)]
        checkpoints: dict[str, dict[int, memoryview]] = {}
        for name, pairs in checkpoint_spans.items():
            where = f"checkpoints[{name!r}]"
            if not isinstance(name, str) or not isinstance(pairs, list):
                raise ProtocolError(ErrorCode.BAD_REQUEST, f"{where} must map a name to pairs")
            placed: dict[int, memoryview] = {}
            for i, pair in enumerate(pairs):
                if not isinstance(pair, list) or len(pair) != 2 or not _is_int(pair[0]):
                    raise ProtocolError(
                        ErrorCode.BAD_REQUEST, f"{where}[{i}] must be [boundary, span]"
                    )
                placed[pair[0]] = conn.span(_span(pair[1], f"{where}[{i}]"))
            checkpoints[name] = placed
        result = await self._run(
            partial(
                self.store.put_state,
                identity,
                tokens,
                paged=paged,
                checkpoints=checkpoints,
                upto_tokens=upto_tokens,
                first_block=first_block,
            )
        )
        return ok_reply(rid, stored=result.stored, existed=result.existed, parts=result.parts)

    async def lookup_state(self, conn: Connection, request: Request) -> dict[str, Any]:
        identity, queries = self._lookup_queries(conn, request.message)

        def run() -> list[JointMatch]:
            return [self.store.lookup_state(identity, t, hashes=h) for t, h in queries]

        matches = await self._run(run)
        results, observed = [], []
        for (tokens, _), match in zip(queries, matches, strict=True):
            match = self._offered(match)
            hit_tokens, hit_bytes = match.reusable_tokens, match.payload_bytes
            result = _joint_result(match)
            result["est_load_s"], result["est_prefill_s"] = self.metrics.benefit(
                hit_tokens, hit_bytes
            )
            results.append(result)
            observed.append((_closed_tokens(tokens, identity), hit_tokens, hit_bytes))
        self._count(identity, observed)
        return ok_reply(request.id, results=results)

    def _offered(self, match: JointMatch) -> JointMatch:
        """`match`, or no hit when it is shorter than `min_reusable_tokens`."""
        if match.reusable_tokens >= self.min_reusable_tokens:
            return match
        return dataclasses.replace(match, reusable_tokens=0, replay_from=0, hashes=(), parts=())

    async def load_state(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid, msg = request.id, request.message
        identity = self._identity(msg)
        tokens = _tokens(conn, msg)
        hashes = _hashes(msg)
        offset, out = _output(conn, msg)
        started = time.perf_counter()
        result = await self._run(
            partial(self.store.load_state, identity, tokens, out, hashes=hashes)
        )
        match = self._offered(result.match)
        self.metrics.observe_load(
            identity.tenant,
            match.reusable_tokens,
            match.payload_bytes,
            time.perf_counter() - started,
        )
        return ok_reply(rid, **_joint_result(match, [offset + o for o in result.offsets]))

    async def purge(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid, msg = request.id, request.message
        dry_run = field(msg, "dry_run", bool, default=False)
        criteria = {k: msg[k] for k in PURGE_FIELDS if k in msg and msg[k] is not None}
        try:
            selector = PurgeSelector.from_dict(criteria)
        except ConfigError as exc:
            raise ProtocolError(ErrorCode.BAD_REQUEST, str(exc)) from None
        if dry_run:
            report = await self._run(partial(self.store.purge, selector, dry_run=True))
        else:
            report = await self._run(partial(self.purge_everywhere, selector))
        return ok_reply(rid, **report.describe())

    async def verify(self, conn: Connection, request: Request) -> dict[str, Any]:
        """Check the store while serving (a read snapshot; writers go on), or repair it (one
        write transaction: other writes wait for it, reads do not)."""
        rid, msg = request.id, request.message
        fix = field(msg, "fix", bool, default=False)
        payloads = field(msg, "payloads", bool, default=True)

        def run() -> dict[str, Any]:
            # the check runs in a child: LMDB may abort the process that meets a damaged page
            problems = run_check(self.store.path, verify_payloads=payloads or fix)
            stats = self.store.stats()
            if fix and not any(p.kind == "pages" for p in problems):
                repaired = self.store.repair(problems)
                stats = self.store.stats()
                return verify_report(stats.blocks, stats.parts, fixed=repaired)
            if fix:  # damage a repair cannot mend: nothing is changed
                unfixed = RepairReport(len(problems), 0, 0, tuple(problems))
                return verify_report(stats.blocks, stats.parts, fixed=unfixed)
            return verify_report(stats.blocks, stats.parts, problems=problems)

        return ok_reply(rid, **await self._run(run))

    async def stats(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid = request.id
        stats = await self._run(self.store.stats)
        metrics = await self._run(self.metrics.snapshot)
        if self.bridge is not None:
            metrics["cluster"] = {**self.bridge.snapshot(), **self.cluster_hits}
        server = {**conn.server.counters(), **self.warmed, "models": dict(self.models)}
        return ok_reply(rid, store=dataclasses.asdict(stats), server=server, metrics=metrics)

    async def health(self, conn: Connection, request: Request) -> dict[str, Any]:
        rid = request.id
        await self._run(self.store.stats)  # the store answers through the pool
        return ok_reply(
            rid,
            status="ok",
            uptime_s=round(time.monotonic() - self.started, 3),
            connections=conn.server.open_connections,
        )

    # --- helpers --------------------------------------------------------------------------------

    async def _run(self, call: Callable[[], T]) -> T:
        """Run blocking store work on the pool; store errors become protocol errors."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.pool, call)
        except Exception as exc:
            raise _protocol_error(exc) from None

    def _identity(self, msg: Mapping[str, Any]) -> Identity:
        raw = field(msg, "identity", dict, code=ErrorCode.BAD_IDENTITY)
        try:
            # the type is part of the key: 4.0 == 4 and True == 1, but only ints are block_tokens
            key = tuple(sorted((name, type(value), value) for name, value in raw.items()))
            cached = self._identities.get(key)
        except TypeError:  # unhashable or unsortable values: let validation name the field
            key, cached = (), None
        if cached is not None:
            return cached
        try:
            identity = Identity.from_dict(raw)
        except IdentityError as exc:
            raise ProtocolError(ErrorCode.BAD_IDENTITY, str(exc)) from None
        if key:
            if len(self._identities) >= _IDENTITY_CACHE:
                self._identities.clear()
            self._identities[key] = identity
        return identity


_NO_HIT = {"n_blocks": 0, "n_tokens": 0, "sizes": b""}


def _lookup_result(match: PrefixMatch) -> dict[str, Any]:
    return {
        "n_blocks": match.n_blocks,
        "n_tokens": match.n_tokens,
        "sizes": _packed(match.payload_sizes),
    }


def _joint_result(match: JointMatch, offsets: Sequence[int] | None = None) -> dict[str, Any]:
    """A joint match on the wire; with `offsets`, where each part was loaded in the region."""
    parts = []
    for i, part in enumerate(match.parts):
        entry = {
            "group": part.group,
            "first_token": part.first_token,
            "tokens": part.tokens,
            "size": part.payload_size,
        }
        if offsets is not None:
            entry["offset"] = offsets[i]
        parts.append(entry)
    return {
        "reusable_tokens": match.reusable_tokens,
        "replay_from": match.replay_from,
        "paged_tokens": match.paged_tokens,
        "matched_tokens": match.matched_tokens,
        "parts": parts,
    }


def _closed_tokens(tokens: bytes | memoryview, identity: Identity) -> int:
    """How many of a prompt's tokens lie in closed blocks (the part a lookup can hit)."""
    bt = identity.block_tokens
    return len(tokens) // TOKEN_BYTES // bt * bt


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _served_versions(msg: Mapping[str, Any]) -> list[tuple[str, str]]:
    """hello's optional `serves`: [{model, weights}, ...], the versions an engine serves."""
    serves = field(msg, "serves", list, default=[])
    pairs = []
    for i, item in enumerate(serves):
        if (
            not isinstance(item, dict)
            or not isinstance(item.get("model"), str)
            or not isinstance(item.get("weights"), str)
            or not item["model"]
            or not item["weights"]
        ):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST, f"serves[{i}] must be a map of non-empty model and weights"
            )
        pairs.append((item["model"], item["weights"]))
    return pairs


def _protocol_error(exc: Exception) -> Exception:
    """A store error as the protocol error a client gets; anything else unchanged (internal)."""
    if isinstance(exc, ProtocolError):
        return exc
    for kind, code in _STORE_ERRORS:
        if isinstance(exc, kind):
            return ProtocolError(code, str(exc))
    return exc


def _tokens(conn: Connection, msg: Mapping[str, Any], where: str = "") -> bytes | memoryview:
    """Packed token ids: inline (`tokens`, a bin) or in a shared region (`tokens_span`,
    [region, offset, n_tokens]), which keeps a long prompt's ids off the socket."""
    span = msg.get("tokens_span")
    if span is not None:
        if "tokens" in msg:
            raise ProtocolError(ErrorCode.BAD_TOKENS, f"{where}tokens and tokens_span both given")
        region, offset, count = _span(span, f"{where}tokens_span")
        tokens: bytes | memoryview = conn.span((region, offset, count * TOKEN_BYTES))
    else:
        tokens = field(msg, "tokens", bytes, code=ErrorCode.BAD_TOKENS)
    if len(tokens) % TOKEN_BYTES:
        raise ProtocolError(
            ErrorCode.BAD_TOKENS, f"{where}tokens is {len(tokens)} bytes, not a multiple of 4"
        )
    count = len(tokens) // TOKEN_BYTES
    declared = msg.get("n_tokens")
    if declared is not None and declared != count:
        raise ProtocolError(
            ErrorCode.BAD_TOKENS,
            f"{where}tokens holds {count} token ids, n_tokens says {declared!r}",
        )
    return tokens


def _output(conn: Connection, msg: Mapping[str, Any]) -> tuple[int, memoryview]:
    """Where a load writes: `region` from `offset` (default 0) for `length` bytes (default: to
    the region's end)."""
    region = conn.region(int_field(msg, "region", high=1 << 31))
    offset = int_field(msg, "offset", default=0)
    length = int_field(msg, "length", default=max(0, region.size - offset))
    return offset, region.span(offset, length)


def _hashes(msg: Mapping[str, Any]) -> bytes | None:
    return field(msg, "hashes", bytes, default=None, code=ErrorCode.BAD_TOKENS)


def _span(span: Any, where: str) -> tuple[int, int, int]:
    if (
        not isinstance(span, list)
        or len(span) != 3
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in span
        )
    ):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"{where} must be [region, offset, length] of ints >= 0"
        )
    return span[0], span[1], span[2]


def _packed(values: Any) -> bytes:
    return np.asarray(values, dtype="<u8").tobytes()


__all__ = ["MAX_REGIONS_PER_CONNECTION", "Operations"]
