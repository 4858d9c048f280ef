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
from collections import OrderedDict, deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

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
_LOAD_SAMPLES = 256  # recent loads the load-time model is fitted to


class LoadTimeModel:
    """Estimated seconds to load `n` bytes: overhead + n / bandwidth, fitted by least squares to
    the recent loads (defaults until loads of at least two sizes were seen)."""

    def __init__(self, overhead_s: float = 300e-6, bandwidth: float = 2e9) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=_LOAD_SAMPLES)
        self._lock = threading.Lock()
        self.overhead_s = overhead_s
        self.bandwidth = bandwidth

    def observe(self, n_bytes: int, seconds: float) -> None:
        with self._lock:
            self._samples.append((float(n_bytes), seconds))
            if len(self._samples) >= 8 and len(self._samples) % 8 == 0:
                self._fit()

    def _fit(self) -> None:
        sizes, times = np.array(self._samples).T
        if np.ptp(sizes) <= 0:
            return
        slope, intercept = np.polyfit(sizes, times, 1)
        if slope > 0:
            self.bandwidth = 1.0 / slope
            self.overhead_s = max(0.0, float(intercept))

    def estimate(self, n_bytes: int) -> float:
        return self.overhead_s + n_bytes / self.bandwidth if n_bytes else 0.0


class _TenantCounters(NamedTuple):
    prompts: Any
    hits: Any
    prompt_tokens: Any
    hit_tokens: Any
    prompt_bytes: Any
    hit_bytes: Any
    loaded_bytes: Any
    loaded_tokens: Any
    saved_seconds: Any


class Metrics:
    """The daemon's counters and histograms, plus the store's totals read at collection time."""

    def __init__(self, store: Store, *, prefill_tokens_per_s: float) -> None:
        self.store = store
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.load_time = LoadTimeModel()
        self._bytes_per_token: OrderedDict[bytes, float] = OrderedDict()
        self._tenants: dict[str, _TenantCounters] = {}
        self._lock = threading.Lock()
        r = self.registry = CollectorRegistry(auto_describe=True)
        tenant = ["tenant"]
        self.prompts = Counter("prefixd_lookup_prompts", "Prompts looked up", tenant, registry=r)
        self.hits = Counter(
            "prefixd_lookup_hits", "Prompts with a hit that was offered", tenant, registry=r
        )
        self.prompt_tokens = Counter(
            "prefixd_prompt_tokens", "Closed-block tokens of the prompts looked up", tenant,
            registry=r,
        )  # fmt: skip
        self.hit_tokens = Counter(
            "prefixd_hit_tokens", "Tokens of the hits offered", tenant, registry=r
        )
        self.prompt_bytes = Counter(
            "prefixd_prompt_bytes",
            "Payload bytes of the prompts' closed blocks (missed ones estimated from the "
            "identity's bytes per token)",
            tenant,
            registry=r,
        )
        self.hit_bytes = Counter(
            "prefixd_hit_bytes", "Payload bytes of the hits", tenant, registry=r
        )
        self.hit_length = Histogram(
            "prefixd_hit_length_tokens", "Tokens per hit offered", buckets=HIT_TOKEN_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.op_seconds = Histogram(
            "prefixd_operation_seconds", "Time to answer a request, by operation", ["op"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.loaded_bytes = Counter(
            "prefixd_loaded_bytes", "Verified payload bytes loaded", tenant, registry=r
        )
        self.loaded_tokens = Counter(
            "prefixd_loaded_tokens", "Tokens whose state was loaded", tenant, registry=r
        )
        self.saved_seconds = Counter(
            "prefixd_prefill_saved_seconds",
            "Prefill time the loads saved, at the configured prefill throughput",
            tenant,
            registry=r,
        )
        self.put_blocks = Counter("prefixd_put_blocks", "Blocks stored by puts", tenant, registry=r)
        r.register(_StoreCollector(store))

    # --- recording -------------------------------------------------------------------------------

    def observe_op(self, op: str, seconds: float) -> None:
        self.op_seconds.labels(op).observe(seconds)

    def observe_lookup(
        self, tenant: str, digest: bytes, prompt_tokens: int, hit_tokens: int, hit_bytes: int
    ) -> None:
        """One prompt looked up; `hit_tokens` is what was offered (0 for a miss)."""
        rate = self._rate(digest, hit_bytes, hit_tokens)
        c = self._of(tenant)
        c.prompts.inc()
        c.prompt_tokens.inc(prompt_tokens)
        self.hit_length.observe(hit_tokens)
        if hit_tokens:
            c.hits.inc()
            c.hit_tokens.inc(hit_tokens)
            c.hit_bytes.inc(hit_bytes)
        c.prompt_bytes.inc(hit_bytes + (prompt_tokens - hit_tokens) * rate)

    def observe_load(self, tenant: str, n_tokens: int, n_bytes: int, seconds: float) -> None:
        if n_bytes:
            self.load_time.observe(n_bytes, seconds)
        c = self._of(tenant)
        c.loaded_bytes.inc(n_bytes)
        c.loaded_tokens.inc(n_tokens)
        c.saved_seconds.inc(n_tokens / self.prefill_tokens_per_s)

    def _of(self, tenant: str) -> _TenantCounters:
        """The tenant's labelled counters (looked up once: `labels()` costs a lock and a dict)."""
        found = self._tenants.get(tenant)
        if found is None and len(self._tenants) >= MAX_TENANT_LABELS:
            return self._of(OTHER_TENANTS)  # label cardinality stays bounded
        if found is None:
            found = _TenantCounters(
                *(getattr(self, name).labels(tenant) for name in _TenantCounters._fields)
            )
            self._tenants[tenant] = found
        return found

    def observe_put(
        self, tenant: str, digest: bytes, blocks: int, tokens: int, n_bytes: int
    ) -> None:
        self.put_blocks.labels(tenant).inc(blocks)
        self._rate(digest, n_bytes, tokens)

    def _rate(self, digest: bytes, n_bytes: int, tokens: int) -> float:
        """The identity's payload bytes per token, updated with this observation if it has any."""
        with self._lock:
            rate = self._bytes_per_token.get(digest, 0.0)
            if tokens and n_bytes:
                rate = n_bytes / tokens if not rate else 0.9 * rate + 0.1 * n_bytes / tokens
                self._bytes_per_token[digest] = rate
                self._bytes_per_token.move_to_end(digest)
                if len(self._bytes_per_token) > _RATE_MEMORY:
                    self._bytes_per_token.popitem(last=False)
            return rate

    def track_cluster(self, bridge: Any) -> None:
        """Expose the shared tier's counts (prefixd.cluster.bridge) as metrics too."""
        self.registry.register(_ClusterCollector(bridge))

    # --- the benefit model --------------------------------------------------------------------

    def benefit(self, hit_tokens: int, hit_bytes: int) -> dict[str, float]:
        """What the engine compares: the estimated seconds to load the hit, and the prefill
        seconds it saves at the configured throughput."""
        return {
            "est_load_s": round(self.load_time.estimate(hit_bytes), 9),
            "est_prefill_s": round(hit_tokens / self.prefill_tokens_per_s, 9),
        }

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
            "hit_length_tokens": _buckets(self.hit_length.collect()),
            "latency_us": _latencies(self.op_seconds.collect()),
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
        ):
            yield CounterMetricFamily(name, doc, value=value)


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


def _ratio(part: float, whole: float) -> float:
    return round(part / whole, 6) if whole else 0.0


def _buckets(families: list[Metric]) -> dict[str, int]:
    """Per-bucket counts (not cumulative) keyed by the bucket's upper bound."""
    counts: dict[str, int] = {}
    previous = 0.0
    for sample in families[0].samples:
        if sample.name.endswith("_bucket"):
            counts[sample.labels["le"]] = int(sample.value - previous)
            previous = sample.value
    return counts


def _latencies(families: list[Metric]) -> dict[str, dict[str, float]]:
    """count, mean, p50 and p99 (bucket upper bounds) in microseconds, per operation."""
    by_op: dict[str, list[tuple[float, float]]] = {}
    sums: dict[str, float] = {}
    for sample in families[0].samples:
        op = sample.labels.get("op", "")
        if sample.name.endswith("_bucket"):
            by_op.setdefault(op, []).append((float(sample.labels["le"]), sample.value))
        elif sample.name.endswith("_sum"):
            sums[op] = sample.value
    out = {}
    for op, buckets in by_op.items():
        count = buckets[-1][1]
        if not count:
            continue
        out[op] = {
            "count": int(count),
            "mean_us": round(sums.get(op, 0.0) / count * 1e6, 1),
            "p50_us": _quantile(buckets, count, 0.5),
            "p99_us": _quantile(buckets, count, 0.99),
        }
    return out


def _quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    for bound, cumulative in buckets:
        if cumulative >= q * count:
            return round(bound * 1e6, 1) if bound != float("inf") else float("inf")
    return float("inf")
