"""What the daemon measures, and the benefit model that tells an engine whether a hit pays.

Hit rate alone is not success: a long hit saves much, a short one can cost more to load than to
recompute. So hits are counted in requests, tokens and bytes, with hit lengths, operation times,
loads and the prefill they saved. One prometheus_client registry owned by the daemon (no globals).
Labels carry tenants and operation names only, never prompts, token ids or keys; every per-tenant
series is capped at MAX_TENANT_LABELS tenants.
"""

from __future__ import annotations

import platform
import threading
from bisect import bisect_left
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from prefixd.clock import Clock, SystemClock
from prefixd.daemon.benefit import LoadTimes, PrefillRates
from prefixd.loadtime import LoadTimeModel
from prefixd.schema.meta import SCHEMA_VERSION
from prefixd.version import __version__

if TYPE_CHECKING:
    from prefixd.store import Store

HIT_TOKENS_TOP = 1 << 20  # hit-length buckets double from the block size up to this many tokens
LATENCY_BUCKETS = (
    50e-6, 100e-6, 200e-6, 300e-6, 500e-6, 1e-3, 2e-3, 5e-3, 10e-3, 20e-3, 50e-3, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
MAX_TENANT_LABELS = 1024  # tenants beyond this many are counted together
OTHER_TENANTS = "_other"
_RATE_MEMORY = 4096  # identities whose bytes per token are remembered (least recent dropped)


# The per-tenant counts: name (prefixd_<name>_total on the wire) and what it counts.
_TALLIES = (
    ("lookup_prompts", "Prompts looked up"),
    ("lookup_hits", "Prompts with a hit that was offered"),
    ("prompt_tokens", "Closed-block tokens of the prompts looked up"),
    ("hit_tokens", "Tokens of the hits offered"),
    (
        "prompt_bytes",
        (
            "Payload bytes of the prompts' closed blocks (missed ones estimated from the "
            "identity's bytes per token)"
        ),
    ),
    ("hit_bytes", "Payload bytes of the hits"),
    ("loaded_bytes", "Verified payload bytes loaded"),
    ("loaded_tokens", "Tokens whose state was loaded"),
    (
        "prefill_saved_seconds",
        (
            "Prefill time the loads saved, at the tenant's prefill throughput (its engines' or "
            "the configured one)"
        ),
    ),
    ("net_saved_seconds", "Prefill time the loads saved minus the time they took"),
    (
        "loads_skipped",
        (
            "Hits found but not offered: loading them would cost more than the prefill they "
            "save, or they are shorter than min_reusable_tokens"
        ),
    ),
    ("put_blocks", "Blocks stored by puts"),
)
(PROMPTS, HITS, PROMPT_TOKENS, HIT_TOKENS, PROMPT_BYTES, HIT_BYTES, LOADED_BYTES, LOADED_TOKENS,
 SAVED_S, NET_SAVED_S, SKIPPED, PUT_BLOCKS) = range(len(_TALLIES))  # fmt: skip


class _Histogram:
    """Counts per bucket and a sum, kept as plain numbers (the lookup path records into it;
    prometheus_client's own costs a lock per call)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts keyed by upper bound, as Prometheus writes them."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class Metrics:
    """The daemon's counts and histograms, plus the store's totals read when scraped."""

    def __init__(
        self, store: Store, *, prefill_tokens_per_s: float, clock: Clock | None = None
    ) -> None:
        self.store = store
        self.prefill_tokens_per_s = prefill_tokens_per_s  # the configured one
        self.load_times = LoadTimes((clock or SystemClock()).monotonic)  # judge hits: per tenant
        self.node_load_time = LoadTimeModel()  # every tenant's loads: shown, never judged by
        self.rates = PrefillRates(prefill_tokens_per_s)
        self._bytes_per_token: OrderedDict[bytes, float] = OrderedDict()
        self._labeled: set[str] = set()  # tenants with series of their own (MAX_TENANT_LABELS)
        self._tenants: dict[str, list[float]] = {}  # by label: a tenant or OTHER_TENANTS
        # Its buckets start at the block size of the first lookup's identity (see observe_lookup)
        self.hit_length: _Histogram | None = None
        self._ops: dict[str, _Histogram] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_BuildInfo())
        self.registry.register(_TallyCollector(self))
        self.registry.register(_StoreCollector(store, self.tenant_labels))
        ProcessCollector(registry=self.registry)  # registers itself: on this registry only

    def observe_op(self, op: str, seconds: float) -> None:
        with self._lock:
            histogram = self._ops.get(op)
            if histogram is None:
                histogram = self._ops[op] = _Histogram(LATENCY_BUCKETS)
            histogram.observe(seconds)

    def observe_lookup(
        self,
        tenant: str,
        digest: bytes,
        prompt_tokens: int,
        hit_tokens: int,
        hit_bytes: int,
        *,
        block_tokens: int,
        skipped: bool = False,
    ) -> None:
        """One prompt looked up; `hit_tokens` is what was offered (0: a miss); `skipped`: a hit
        was found and not offered (the benefit rule). The first lookup's `block_tokens` fixes the
        hit-length buckets (they never change) so that a one-block hit shows as one."""
        with self._lock:
            rate = self._rate(digest, hit_bytes, hit_tokens)
            t = self._of(tenant)
            t[PROMPTS] += 1
            t[SKIPPED] += skipped
            t[PROMPT_TOKENS] += prompt_tokens
            t[PROMPT_BYTES] += hit_bytes + (prompt_tokens - hit_tokens) * rate
            if self.hit_length is None:
                self.hit_length = _Histogram(hit_token_bounds(block_tokens))
            self.hit_length.observe(hit_tokens)
            if hit_tokens:
                t[HITS] += 1
                t[HIT_TOKENS] += hit_tokens
                t[HIT_BYTES] += hit_bytes

    def observe_load(self, tenant: str, n_tokens: int, n_bytes: int, seconds: float) -> None:
        if n_bytes:
            self.load_times.observe(tenant, n_bytes, seconds)
            self.node_load_time.observe(n_bytes, seconds)
        with self._lock:
            t = self._of(tenant)
            t[LOADED_BYTES] += n_bytes
            t[LOADED_TOKENS] += n_tokens
            saved_s = n_tokens / self.rates.of(tenant)
            t[SAVED_S] += saved_s
            t[NET_SAVED_S] += saved_s - seconds

    def observe_put(
        self, tenant: str, digest: bytes, blocks: int, tokens: int, n_bytes: int
    ) -> None:
        with self._lock:
            self._of(tenant)[PUT_BLOCKS] += blocks
            self._rate(digest, n_bytes, tokens)

    def _of(self, tenant: str) -> list[float]:
        """The tallies of the tenant's label (under the lock)."""
        label = self._label(tenant)
        found = self._tenants.get(label)
        if found is None:
            found = self._tenants[label] = [0.0] * len(_TALLIES)
        return found

    def _label(self, tenant: str) -> str:
        """The tenant's own name for the first MAX_TENANT_LABELS tenants seen, else OTHER_TENANTS
        (under the lock). A label never changes while the daemon runs, so a counter summed under
        OTHER_TENANTS only grows."""
        if tenant in self._labeled:
            return tenant
        if len(self._labeled) >= MAX_TENANT_LABELS:
            return OTHER_TENANTS
        self._labeled.add(tenant)
        return tenant

    def tenant_labels(self, tenants: Iterable[str]) -> dict[str, str]:
        """Each tenant's label; the store's tenants are labeled in name order."""
        with self._lock:
            return {tenant: self._label(tenant) for tenant in sorted(tenants)}

    def _rate(self, digest: bytes, n_bytes: int, tokens: int) -> float:
        """The identity's payload bytes per token, updated with this observation (under the lock)."""
        rate = self._bytes_per_token.get(digest, 0.0)
        if tokens and n_bytes:
            rate = n_bytes / tokens if not rate else 0.9 * rate + 0.1 * n_bytes / tokens
            self._bytes_per_token[digest] = rate
            self._bytes_per_token.move_to_end(digest)
            if len(self._bytes_per_token) > _RATE_MEMORY:
                self._bytes_per_token.popitem(last=False)
        return rate

    def tallies(
        self,
    ) -> tuple[dict[str, list[float]], _Histogram | None, dict[str, _Histogram]]:
        """A consistent copy: per-tenant tallies, hit lengths (None before the first lookup), op
        histograms."""
        with self._lock:
            tenants = {t: list(v) for t, v in self._tenants.items()}
            lengths = _copy_histogram(self.hit_length) if self.hit_length is not None else None
            ops = {op: _copy_histogram(h) for op, h in self._ops.items()}
        return tenants, lengths, ops

    def track_cluster(self, bridge: Any) -> None:
        gauges = {"publish_queued": "Blocks waiting to be published"}
        self.registry.register(_SnapshotCollector(bridge, "prefixd_cluster", "Shared tier", gauges))

    def track_events(self, publisher: Any) -> None:
        gauges = {"queued_events": "KV events: queued events"}
        self.registry.register(
            _SnapshotCollector(publisher, "prefixd_kv_events", "KV events", gauges)
        )

    def snapshot(self) -> dict[str, Any]:
        """The summary `prefixd stats` prints. The store's per-tenant totals are every tenant's,
        uncapped (no time series; the lmcache adapter lists tenants from it)."""
        tallies, lengths, ops = self.tallies()
        tenants: dict[str, dict[str, float]] = {
            label: {name: values[i] for i, (name, _) in enumerate(_TALLIES)}
            for label, values in tallies.items()
        }
        for tenant, stored in self.store.tenant_totals().items():
            entry = tenants.setdefault(tenant, {})
            entry["stored_bytes"] = float(stored["stored_bytes"])
            entry["stored_blocks"] = float(stored["blocks"])
        for tenant, reasons in self.store.removals().items():
            for reason, count in reasons.items():
                tenants.setdefault(tenant, {})[f"{reason}_blocks"] = float(count)
        totals: dict[str, float] = dict.fromkeys(_SUMMED, 0.0)
        for values in tenants.values():
            for name, value in values.items():
                totals[name] = totals.get(name, 0.0) + value
        for tenant, model in self.load_times.learned().items():  # what its hits are judged by
            entry = tenants.setdefault(tenant, {})
            entry["load_overhead_us"] = round(model.overhead_s * 1e6, 1)
            entry["load_bandwidth_gbps"] = round(model.bandwidth / 1e9, 3)
        return {
            "hit_rate": {
                "requests": _ratio(totals["lookup_hits"], totals["lookup_prompts"]),
                "tokens": _ratio(totals["hit_tokens"], totals["prompt_tokens"]),
                "bytes": _ratio(totals["hit_bytes"], totals["prompt_bytes"]),
            },
            "totals": totals,
            "hit_length_tokens": _per_bucket(lengths) if lengths is not None else {},
            "latency_us": _latencies(ops),
            "load_model": {
                "overhead_us": round(self.node_load_time.overhead_s * 1e6, 1),
                "bandwidth_gbps": round(self.node_load_time.bandwidth / 1e9, 3),
            },
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "tenants": tenants,
            "sync": _sync_state(self.store),
        }


_SUMMED = (*(name for name, _ in _TALLIES), "stored_bytes", "stored_blocks")  # in totals


class _Lazy:
    """A collector read only when collected: the store may be busy when the registry is built."""

    def describe(self) -> list[Metric]:
        return []


class _BuildInfo(_Lazy):
    def __init__(self) -> None:
        self.labels = {
            "version": __version__,
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "schema_version": str(SCHEMA_VERSION),
        }

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "prefixd_build_info",
            "Always 1: the daemon's version, its Python's, the store format it writes",
            labels=list(self.labels),
        )
        info.add_metric(list(self.labels.values()), 1)
        yield info


# The store's totals (prefixd.store.results.StoreStats): name, field, scale, help
_STORE_GAUGES = (
    ("store_payload_bytes", "payload_bytes", 1, "Payload bytes before compression"),
    ("store_map_used_bytes", "map_used_bytes", 1, "Bytes of the LMDB map in use"),
    ("store_map_size_bytes", "map_size", 1, "LMDB map size"),
    ("store_parts", "parts", 1, "State-group payloads of hybrid identities"),
    ("compression_ratio", "compression_ratio", 1, "Payload over stored bytes"),
    ("compress_bytes_per_second", "compress_gbps", 1e9, "Compression speed (payload bytes in)"),
    (
        "decompress_bytes_per_second",
        "decompress_gbps",
        1e9,
        "Decompression speed (payload bytes out)",
    ),
    (
        "verify_copy_bytes_per_second",
        "copy_verify_gbps",
        1e9,
        "Speed of verified copies (payloads stored raw)",
    ),
)
_STORE_COUNTS = (
    ("quarantined_blocks", "quarantined", 1, "Blocks that failed verification"),
    ("hash_collisions", "collisions", 1, "Hash collisions seen (counted misses)"),
    ("verify_failures", "verify_failures", 1, "Payloads that failed checksums"),
    (
        "load_deadline_cutoffs",
        "deadline_cutoffs",
        1,
        "Loads that stopped reading at their deadline (a shorter hit)",
    ),
)


class _StoreCollector(_Lazy):
    """The store's totals, under the daemon's (capped) tenant labels."""

    def __init__(self, store: Store, label: Callable[[Iterable[str]], dict[str, str]]) -> None:
        self.store = store
        self.label = label

    def collect(self) -> Iterator[Metric]:
        store = self.store
        stats = store.stats()
        tenant_totals, removals = store.tenant_totals(), store.removals()
        labels = self.label(tenant_totals.keys() | removals.keys())
        stored: Counter[str] = Counter()
        blocks: Counter[str] = Counter()
        for tenant, totals in tenant_totals.items():
            stored[labels[tenant]] += totals["stored_bytes"]
            blocks[labels[tenant]] += totals["blocks"]
        removed: Counter[tuple[str, str]] = Counter()
        for tenant, reasons in removals.items():
            for reason, count in reasons.items():
                removed[labels[tenant], reason] += count
        yield _per_tenant("prefixd_stored_bytes", "Stored bytes", stored)
        yield _per_tenant("prefixd_stored_blocks", "Stored blocks", blocks)
        removed_family = CounterMetricFamily(
            "prefixd_removed_blocks",
            "Blocks removed since the daemon started, by reason (evicted, quarantined, retired, "
            "purged, expired, deleted, replaced)",
            labels=["tenant", "reason"],
        )
        for (label, reason), count in sorted(removed.items()):
            removed_family.add_metric([label, reason], count)
        yield removed_family
        for name, field, scale, doc in _STORE_GAUGES:
            yield GaugeMetricFamily(f"prefixd_{name}", doc, value=getattr(stats, field) * scale)
        for name, field, scale, doc in _STORE_COUNTS:
            yield CounterMetricFamily(f"prefixd_{name}", doc, value=getattr(stats, field) * scale)
        sync = _sync_state(store)
        yield GaugeMetricFamily(
            "prefixd_store_sync_failed",
            "1 once an fsync of the store failed: writes are refused (reads go on) until a "
            "restart checks what was written since the last good sync",
            value=float(sync["failed"]),
        )
        yield GaugeMetricFamily(
            "prefixd_store_last_sync_timestamp_seconds",
            "When the last fsync of the store that succeeded began (Unix time; 0: none yet)",
            value=sync["last_good_s"],
        )


def _sync_state(store: Store) -> dict[str, Any]:
    failure = store.sync_failure
    return {
        "failed": failure is not None,
        "last_good_s": store.last_sync_ns / 1e9,
        "error": failure.describe() if failure is not None else None,
    }


class _TallyCollector(_Lazy):
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        tenants, lengths, ops = self.metrics.tallies()
        for i, (name, doc) in enumerate(_TALLIES):
            family = CounterMetricFamily(f"prefixd_{name}", doc, labels=["tenant"])
            for tenant, values in sorted(tenants.items()):
                family.add_metric([tenant], values[i])
            yield family
        hits = HistogramMetricFamily(
            "prefixd_hit_length_tokens",
            "Tokens per hit offered (0: a miss); buckets double from the block size",
        )
        if lengths is not None:
            hits.add_metric([], lengths.buckets(), lengths.sum)
        yield hits
        times = HistogramMetricFamily(
            "prefixd_operation_seconds", "Time to answer a request, by operation", labels=["op"]
        )
        for op, histogram in sorted(ops.items()):
            times.add_metric([op], histogram.buckets(), histogram.sum)
        yield times


class _SnapshotCollector(_Lazy):
    """A part's `snapshot()` counts as `prefix`_NAME counters, `gauges` as gauges."""

    def __init__(self, source: Any, prefix: str, what: str, gauges: dict[str, str]) -> None:
        self.source, self.prefix, self.what, self.gauges = source, prefix, what, gauges

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self.source.snapshot().items()):
            metric = f"{self.prefix}_{name}"
            if name in self.gauges:
                yield GaugeMetricFamily(metric, self.gauges[name], value=value)
            else:
                text = f"{self.what}: {name.replace('_', ' ')}"
                yield CounterMetricFamily(metric, text, value=value)


def hit_token_bounds(block_tokens: int) -> tuple[int, ...]:
    """0 (the misses), then one block, two, four, ... up to HIT_TOKENS_TOP tokens, so hits of a few
    blocks are told apart at any block size."""
    bounds = [0]
    bound = max(1, block_tokens)
    while True:
        bounds.append(bound)
        if bound >= HIT_TOKENS_TOP:
            return tuple(bounds)
        bound *= 2


def _per_tenant(name: str, doc: str, by_tenant: Counter[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["tenant"])
    for tenant, value in sorted(by_tenant.items()):
        family.add_metric([tenant], value)
    return family


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole else 0.0


def _copy_histogram(histogram: _Histogram) -> _Histogram:
    copy = _Histogram(histogram.bounds)
    copy.counts, copy.sum = list(histogram.counts), histogram.sum
    return copy


def _per_bucket(histogram: _Histogram) -> dict[str, int]:
    bounds = [repr(float(b)) for b in histogram.bounds] + ["+Inf"]
    return dict(zip(bounds, histogram.counts, strict=True))


def _latencies(ops: dict[str, _Histogram]) -> dict[str, dict[str, float]]:
    """count, mean, p50 and p99 (bucket upper bounds) in microseconds, per operation."""
    out = {}
    for op, histogram in ops.items():
        cumulative = [(float(bound), count) for bound, count in histogram.buckets()]
        count = cumulative[-1][1]
        if not count:
            continue
        out[op] = {
            "count": int(count),
            "mean_us": round(histogram.sum / count * 1e6, 1),
            "p50_us": _quantile(cumulative, count, 0.5),
            "p99_us": _quantile(cumulative, count, 0.99),
        }
    return out


def _quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    for bound, cumulative in buckets:
        if cumulative >= q * count:
            return round(bound * 1e6, 1) if bound != float("inf") else float("inf")
    return float("inf")
