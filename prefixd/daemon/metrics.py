"""What the daemon measures, and the benefit model that tells an engine whether a hit pays.

Hit rate alone is not success: a long hit can save much and a short one can cost more to load
than to recompute. The daemon counts hits at three levels (requests, tokens, bytes), the hit
lengths, the time of every operation, what was loaded and what that saved in prefill-seconds,
and reads the store's own totals (per tenant) when asked. Everything lives in one
prometheus_client registry owned by the daemon (no globals), exposed over a loopback HTTP port or
a textfile for node_exporter when configured, and as a JSON snapshot in the `stats` operation.
Labels carry tenants and operation names only: never prompts, token ids or keys.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from prefixd.loadtime import LoadTimeModel

if TYPE_CHECKING:
    from prefixd.store import Store

HIT_TOKEN_BUCKETS = (0, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
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
        "Payload bytes of the prompts' closed blocks (missed ones estimated from the identity's "
        "bytes per token)",
    ),
    ("hit_bytes", "Payload bytes of the hits"),
    ("loaded_bytes", "Verified payload bytes loaded"),
    ("loaded_tokens", "Tokens whose state was loaded"),
    ("prefill_saved_seconds", "Prefill time the loads saved, at the configured prefill throughput"),
    ("put_blocks", "Blocks stored by puts"),
)
(PROMPTS, HITS, PROMPT_TOKENS, HIT_TOKENS, PROMPT_BYTES, HIT_BYTES, LOADED_BYTES, LOADED_TOKENS,
 SAVED_S, PUT_BLOCKS) = range(len(_TALLIES))  # fmt: skip


class _Histogram:
    """Counts per bucket and a sum: what a Prometheus histogram exposes, kept as plain numbers
    (the lookup path records into it, and prometheus_client's own costs a lock per call)."""

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
    """The daemon's counts and histograms, plus the store's totals read at collection time.

    Recording is a few additions under one lock; the registry reads them when it is scraped."""

    def __init__(self, store: Store, *, prefill_tokens_per_s: float) -> None:
        self.store = store
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.load_time = LoadTimeModel()
        self._bytes_per_token: OrderedDict[bytes, float] = OrderedDict()
        self._tenants: dict[str, list[float]] = {}
        self.hit_length = _Histogram(HIT_TOKEN_BUCKETS)
        self._ops: dict[str, _Histogram] = {}
        self._lock = threading.Lock()
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_TallyCollector(self))
        self.registry.register(_StoreCollector(store))

    # --- recording -------------------------------------------------------------------------------

    def observe_op(self, op: str, seconds: float) -> None:
        with self._lock:
            histogram = self._ops.get(op)
            if histogram is None:
                histogram = self._ops[op] = _Histogram(LATENCY_BUCKETS)
            histogram.observe(seconds)

    def observe_lookup(
        self, tenant: str, digest: bytes, prompt_tokens: int, hit_tokens: int, hit_bytes: int
    ) -> None:
        """One prompt looked up; `hit_tokens` is what was offered (0 for a miss)."""
        with self._lock:
            rate = self._rate(digest, hit_bytes, hit_tokens)
            t = self._of(tenant)
            t[PROMPTS] += 1
            t[PROMPT_TOKENS] += prompt_tokens
            t[PROMPT_BYTES] += hit_bytes + (prompt_tokens - hit_tokens) * rate
            self.hit_length.observe(hit_tokens)
            if hit_tokens:
                t[HITS] += 1
                t[HIT_TOKENS] += hit_tokens
                t[HIT_BYTES] += hit_bytes

    def observe_load(self, tenant: str, n_tokens: int, n_bytes: int, seconds: float) -> None:
        if n_bytes:
            self.load_time.observe(n_bytes, seconds)
        with self._lock:
            t = self._of(tenant)
            t[LOADED_BYTES] += n_bytes
            t[LOADED_TOKENS] += n_tokens
            t[SAVED_S] += n_tokens / self.prefill_tokens_per_s

    def observe_put(
        self, tenant: str, digest: bytes, blocks: int, tokens: int, n_bytes: int
    ) -> None:
        with self._lock:
            self._of(tenant)[PUT_BLOCKS] += blocks
            self._rate(digest, n_bytes, tokens)

    def _of(self, tenant: str) -> list[float]:
        """The tenant's tallies (call under the lock); tenants past MAX_TENANT_LABELS share one
        set, so label cardinality stays bounded."""
        found = self._tenants.get(tenant)
        if found is None:
            if len(self._tenants) >= MAX_TENANT_LABELS:
                tenant = OTHER_TENANTS
            found = self._tenants.setdefault(tenant, [0.0] * len(_TALLIES))
        return found

    def _rate(self, digest: bytes, n_bytes: int, tokens: int) -> float:
        """The identity's payload bytes per token, updated with this observation if it has any
        (call under the lock)."""
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
    ) -> tuple[dict[str, list[float]], list[tuple[str, float]], float, dict[str, _Histogram]]:
        """A consistent copy: per-tenant tallies, the hit-length buckets and sum, the op
        histograms."""
        with self._lock:
            tenants = {t: list(v) for t, v in self._tenants.items()}
            lengths, length_sum = self.hit_length.buckets(), self.hit_length.sum
            ops = {op: _copy_histogram(h) for op, h in self._ops.items()}
        return tenants, lengths, length_sum, ops

    def track_cluster(self, bridge: Any) -> None:
        """Expose the shared tier's counts (prefixd.cluster.bridge) as metrics too."""
        self.registry.register(_ClusterCollector(bridge))

    def track_events(self, publisher: Any) -> None:
        """Expose the KV event publisher's counts (prefixd.daemon.events) as metrics too."""
        self.registry.register(_EventsCollector(publisher))

    # --- the benefit model --------------------------------------------------------------------

    def benefit(self, hit_tokens: int, hit_bytes: int) -> tuple[float, float]:
        """What the engine compares: the estimated seconds to load the hit, and the prefill
        seconds it saves at the configured throughput."""
        return self.load_time.estimate(hit_bytes), hit_tokens / self.prefill_tokens_per_s

    # --- reading -----------------------------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The readable summary `prefixd stats` prints (rates, histograms, per tenant)."""
        tenants: dict[str, dict[str, float]] = {}
        for metric in self.registry.collect():
            for sample in metric.samples:
                who = sample.labels.get("tenant")
                if who is None or sample.name.endswith("_created"):
                    continue
                name = sample.name.removeprefix("prefixd_").removesuffix("_total")
                if "reason" in sample.labels:
                    name = f"{sample.labels['reason']}_blocks"
                tenants.setdefault(who, {})[name] = sample.value
        totals: dict[str, float] = dict.fromkeys(_SUMMED, 0.0)
        for values in tenants.values():
            for name, value in values.items():
                totals[name] = totals.get(name, 0.0) + value
        return {
            "hit_rate": {
                "requests": _ratio(totals["lookup_hits"], totals["lookup_prompts"]),
                "tokens": _ratio(totals["hit_tokens"], totals["prompt_tokens"]),
                "bytes": _ratio(totals["hit_bytes"], totals["prompt_bytes"]),
            },
            "totals": totals,
            "hit_length_tokens": _per_bucket(self.hit_length),
            "latency_us": _latencies(self.tallies()[3]),
            "load_model": {
                "overhead_us": round(self.load_time.overhead_s * 1e6, 1),
                "bandwidth_gbps": round(self.load_time.bandwidth / 1e9, 3),
            },
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "tenants": tenants,
        }


_SUMMED = (
    "lookup_prompts",
    "lookup_hits",
    "prompt_tokens",
    "hit_tokens",
    "prompt_bytes",
    "hit_bytes",
    "loaded_bytes",
    "loaded_tokens",
    "prefill_saved_seconds",
    "put_blocks",
    "stored_bytes",
    "stored_blocks",
)


class _StoreCollector:
    """The store's totals, read when metrics are collected (they live in the store, persisted)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def describe(self) -> list[Metric]:
        return []  # collected lazily: the store may be busy when the registry is built

    def collect(self) -> Iterator[Metric]:
        store = self.store
        stats = store.stats()
        stored = GaugeMetricFamily("prefixd_stored_bytes", "Stored bytes", labels=["tenant"])
        blocks = GaugeMetricFamily("prefixd_stored_blocks", "Stored blocks", labels=["tenant"])
        for tenant, totals in sorted(store.tenant_totals().items()):
            stored.add_metric([tenant], totals["stored_bytes"])
            blocks.add_metric([tenant], totals["blocks"])
        removed = CounterMetricFamily(
            "prefixd_removed_blocks",
            "Blocks removed since the daemon started, by reason (evicted, quarantined, retired, "
            "purged, expired, deleted, replaced)",
            labels=["tenant", "reason"],
        )
        for tenant, reasons in sorted(store.removals().items()):
            for reason, count in sorted(reasons.items()):
                removed.add_metric([tenant, reason], count)
        yield from (stored, blocks, removed)
        for name, value, doc in (
            (
                "prefixd_store_payload_bytes",
                stats.payload_bytes,
                "Payload bytes before compression",
            ),
            ("prefixd_store_map_used_bytes", stats.map_used_bytes, "Bytes of the LMDB map in use"),
            ("prefixd_store_map_size_bytes", stats.map_size, "LMDB map size"),
            ("prefixd_store_parts", stats.parts, "State-group payloads of hybrid identities"),
            ("prefixd_compression_ratio", stats.compression_ratio, "Payload over stored bytes"),
            ("prefixd_compress_gbps", stats.compress_gbps, "Compression speed, GB/s"),
            ("prefixd_decompress_gbps", stats.decompress_gbps, "Decompression speed, GB/s"),
            ("prefixd_verify_copy_gbps", stats.copy_verify_gbps, "Verified copy speed, GB/s"),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        for name, value, doc in (
            ("prefixd_quarantined_blocks", stats.quarantined, "Blocks that failed verification"),
            ("prefixd_hash_collisions", stats.collisions, "Hash collisions seen (counted misses)"),
            ("prefixd_verify_failures", stats.verify_failures, "Payloads that failed checksums"),
            (
                "prefixd_load_deadline_cutoffs",
                stats.deadline_cutoffs,
                "Loads that stopped reading at their deadline (a shorter hit)",
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class _TallyCollector:
    """The daemon's own counts as Prometheus families, read when scraped."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        tenants, lengths, length_sum, ops = self.metrics.tallies()
        for i, (name, doc) in enumerate(_TALLIES):
            family = CounterMetricFamily(f"prefixd_{name}", doc, labels=["tenant"])
            for tenant, values in sorted(tenants.items()):
                family.add_metric([tenant], values[i])
            yield family
        hits = HistogramMetricFamily("prefixd_hit_length_tokens", "Tokens per hit offered")
        hits.add_metric([], lengths, length_sum)
        yield hits
        times = HistogramMetricFamily(
            "prefixd_operation_seconds", "Time to answer a request, by operation", labels=["op"]
        )
        for op, histogram in sorted(ops.items()):
            times.add_metric([op], histogram.buckets(), histogram.sum)
        yield times


class _ClusterCollector:
    """The shared tier's counts: remote hits, fetches, verification failures, errors."""

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self.bridge.snapshot().items()):
            if name == "publish_queued":
                yield GaugeMetricFamily(
                    "prefixd_cluster_publish_queued", "Blocks waiting to be published", value=value
                )
            else:
                yield CounterMetricFamily(
                    f"prefixd_cluster_{name}", f"Shared tier: {name.replace('_', ' ')}", value=value
                )


class _EventsCollector:
    """The KV event publisher's counts: events and batches published, dropped, queued."""

    def __init__(self, publisher: Any) -> None:
        self.publisher = publisher

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        for name, value in sorted(self.publisher.snapshot().items()):
            metric = f"prefixd_kv_events_{name}"
            text = f"KV events: {name.replace('_', ' ')}"
            if name == "queued_events":
                yield GaugeMetricFamily(metric, text, value=value)
            else:
                yield CounterMetricFamily(metric, text, value=value)


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole else 0.0


def _copy_histogram(histogram: _Histogram) -> _Histogram:
    copy = _Histogram(histogram.bounds)
    copy.counts, copy.sum = list(histogram.counts), histogram.sum
    return copy


def _per_bucket(histogram: _Histogram) -> dict[str, int]:
    """Per-bucket counts (not cumulative) keyed by the bucket's upper bound."""
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
