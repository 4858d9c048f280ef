"""What every handler shares: the store (extended by the shared tier when set), the pools, the
limits, the metrics and the daemon's counters.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from prefixd.clock import Clock, SystemClock
from prefixd.daemon.benefit import BenefitRule
from prefixd.daemon.fields import closed_tokens, packed
from prefixd.daemon.metrics import Metrics
from prefixd.daemon.routing import LoadQueue
from prefixd.errors import IdentityError, ProtocolError
from prefixd.schema.identity import Identity
from prefixd.store import PrefixMatch, PurgeSelector, Store
from prefixd.store.purge import PurgeReport
from prefixd.store.results import LoadResult
from prefixd.wire.errors import ErrorCode, code_of
from prefixd.wire.messages import LookupResult, WireIdentity

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from prefixd.cluster.bridge import SharedTierBridge

T = TypeVar("T")
Query = tuple[bytes | memoryview, bytes | None]  # a prompt's token ids, and its hashes if given


class Observed(NamedTuple):
    """What a lookup counts per prompt: its closed tokens, the hit offered, and whether a hit
    found was held back by the benefit rule."""

    prompt_tokens: int
    hit_tokens: int
    hit_bytes: int
    skipped: bool


_IDENTITY_CACHE = 1024


@dataclass(kw_only=True, eq=False)
class Services:
    """verify and purge run on `admin_pool`, one at a time, apart from lookups and loads."""

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
    verifying: bool = field(default=False, init=False)
    loads: LoadQueue = field(default_factory=LoadQueue)  # what `route` counts as the queue
    # what engines loaded as restart warm-up (`hot` listings, `load` with `warm`)
    warmed: Counter[str] = field(
        default_factory=lambda: Counter(warm_listings=0, warmed_blocks=0, warmed_bytes=0)
    )
    cluster_hits: Counter[str] = field(
        default_factory=lambda: Counter(local_hit_blocks=0, remote_hit_blocks=0)
    )
    # the bytes each tenant's pins hold, over every connection (prefixd.daemon.engine_ops)
    pinned_bytes: Counter[str] = field(default_factory=Counter)
    pins_cut_blocks: int = 0  # hits a pinning lookup cut short at its tenant's PIN_SHARE
    # Names this run of the daemon: a client that finds another one after reconnecting knows
    # the old one can no longer touch the region spans its lost requests named.
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    started: float = field(init=False)
    benefit: BenefitRule = field(init=False)  # which hits a lookup offers
    _identities: dict[WireIdentity, Identity] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.started = self.clock.monotonic()
        self.benefit = BenefitRule(
            self.metrics.load_times, self.metrics.rates, self.min_reusable_tokens
        )

    async def run(self, call: Callable[[], T], pool: Executor | None = None) -> T:
        """Run blocking store work on the pool; store errors become protocol errors."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(pool or self.pool, call)
        except Exception as exc:  # noqa: BLE001 - protocol_error re-raises what is no store error
            raise protocol_error(exc) from None

    def identity(self, wire: WireIdentity) -> Identity:
        """Parsed identities cached by their (frozen, type-checked) wire form, so 4.0 or True never
        pass for 4 or 1."""
        cached = self._identities.get(wire)
        if cached is not None:
            return cached
        try:
            identity = wire.to_identity().servable()
        except IdentityError as exc:
            raise ProtocolError(ErrorCode.BAD_IDENTITY, str(exc)) from None
        if len(self._identities) >= _IDENTITY_CACHE:
            self._identities.clear()
        self._identities[wire] = identity
        return identity

    def deadline(self, asked_s: float | None) -> float | None:
        """When a load arriving now stops reading (the client's limit, else load_deadline_s); None:
        never."""
        limit_s = asked_s or self.load_deadline_s
        return self.clock.monotonic() + limit_s if limit_s else None

    def longest_prefix(
        self, identity: Identity, tokens: bytes | memoryview, hashes: bytes | None
    ) -> PrefixMatch:
        """The local prefix, extended from the shared tier first when set."""
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
        """`Store.load` after a read-through, continued from the staged blocks."""
        if self.bridge is None:
            return self.store.load(identity, tokens, out, **options)
        if not options.get("first_block"):
            self.longest_prefix(identity, tokens, options.get("hashes"))
        return self.bridge.load(identity, tokens, out, **options)

    def retire(self, selector: PurgeSelector) -> int:
        """Retire other versions of a served model (a hello that `serves` it, a manifest's
        change); blocks removed. Skipped once an fsync failed: the store writes nothing more, and
        reads must go on for the engine that asked."""
        if self.store.sync_failure is not None:
            log.warning("other versions of a model were not retired: an fsync of the store failed")
            return 0
        return self.purge_everywhere(selector).blocks

    def purge_everywhere(self, selector: PurgeSelector, *, keep_known: bool = False) -> PurgeReport:
        """Purge the store, then the tier's copies of identities removed whole: of a tenant
        purged whole, every node's. `keep_known`: see Store.purge."""
        if self.bridge is None:
            return self.store.purge(selector, keep_known=keep_known)
        whole = selector.model is None and selector.older_than_s is None
        purge = partial(self.store.purge, selector, keep_known=keep_known)
        return self.bridge.purge(purge, selector.tenant if whole else None)

    def lookup_results(
        self,
        identity: Identity,
        queries: Sequence[Query],
        matches: Sequence[PrefixMatch | None],
        reported: float | None = None,
        *,
        judged: bool = True,
    ) -> tuple[list[LookupResult], list[Observed]]:
        """A lookup's replies and what to count per prompt. A hit is offered only where the
        benefit rule says loading it pays (prefixd.daemon.benefit; `reported`: the prefill
        throughput the engine sent; not `judged`: every hit from the floor up, a question of
        what is stored); the reply's estimates are the hit's found."""
        results, observed = [], []
        rate = self.benefit.report(identity.tenant, reported)
        for (tokens, _), match in zip(queries, matches, strict=True):
            assert match is not None
            benefit = self.benefit.judge(identity.tenant, match.n_tokens, match.payload_bytes, rate)
            offered = self.benefit.offered(match.n_tokens, benefit, judged=judged)
            n_tokens = match.n_tokens if offered else 0
            n_bytes = match.payload_bytes if offered else 0
            results.append(
                LookupResult(
                    n_blocks=match.n_blocks if offered else 0,
                    n_tokens=n_tokens,
                    sizes=packed(match.payload_sizes) if offered else b"",
                    est_load_s=benefit.load_s,
                    est_prefill_s=benefit.prefill_s,
                    withheld_tokens=match.n_tokens - n_tokens,
                )
            )
            prompt_tokens = closed_tokens(tokens, identity)
            observed.append(Observed(prompt_tokens, n_tokens, n_bytes, n_tokens < match.n_tokens))
        return results, observed

    def count(self, identity: Identity, observed: list[Observed]) -> None:
        for prompt_tokens, hit_tokens, hit_bytes, skipped in observed:
            self.metrics.observe_lookup(
                identity.tenant,
                identity.digest,
                prompt_tokens,
                hit_tokens,
                hit_bytes,
                block_tokens=identity.block_tokens,
                skipped=skipped,
            )


def on_loop(call: Callable[[], T]) -> T:
    """Store work memory answers, on the event loop, its errors mapped as `run` maps them."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - as in Services.run
        raise protocol_error(exc) from None


def protocol_error(exc: Exception) -> Exception:
    """A store error as the client's protocol error; anything else, or one that says `internal`,
    unchanged (the server logs it)."""
    if isinstance(exc, ProtocolError):
        return exc
    code = code_of(exc)
    if code is None or code is ErrorCode.INTERNAL:
        return exc
    return ProtocolError(code, str(exc))
