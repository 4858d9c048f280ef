"""`prefixd stats` for people: the stats reply as tables, answering what an operator asks first:
does the cache save anything, how fast is it, what does it hold and lose (per tenant).
"""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table

_REASONS = ("evicted", "quarantined", "retired", "purged", "expired")


def render(reply: dict[str, Any]) -> Group:
    """The stats reply (`store`, `server`, `metrics`) as a group of tables."""
    metrics = reply.get("metrics", {})
    store = reply.get("store", {})
    return Group(
        _summary(metrics, store, reply.get("server", {})),
        _latencies(metrics.get("latency_us", {})),
        _hit_lengths(metrics.get("hit_length_tokens", {})),
        _tenants(metrics.get("tenants", {})),
    )


def _summary(metrics: dict[str, Any], store: dict[str, Any], server: dict[str, Any]) -> Table:
    rates = metrics.get("hit_rate", {})
    totals = metrics.get("totals", {})
    model = metrics.get("load_model", {})
    table = Table(title="prefixd", show_header=False, title_justify="left")
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("hit rate: requests / tokens / bytes", " / ".join(_pct(rates.get(k)) for k in ("requests", "tokens", "bytes"))),
        ("prompts looked up", _int(totals.get("lookup_prompts"))),
        ("tokens loaded", _int(totals.get("loaded_tokens"))),
        ("bytes loaded", _size(totals.get("loaded_bytes"))),
        ("prefill saved", f"{totals.get('prefill_saved_seconds', 0.0):,.1f} s at {metrics.get('prefill_tokens_per_s', 0):,.0f} tok/s"),
        ("load model", f"{model.get('overhead_us', 0)} us + bytes / {model.get('bandwidth_gbps', 0)} GB/s"),
        ("stored", f"{_size(store.get('stored_bytes'))} in {_int(store.get('blocks'))} blocks, {_int(store.get('parts'))} parts"),
        ("map used", f"{_size(store.get('map_used_bytes'))} of {_size(store.get('map_size'))}"),
        ("compression", f"x{store.get('compression_ratio', 1.0):.2f}; decompress {store.get('decompress_gbps', 0.0):.2f} GB/s; verified copy {store.get('copy_verify_gbps', 0.0):.2f} GB/s"),
        ("quarantined / collisions", f"{_int(store.get('quarantined'))} / {_int(store.get('collisions'))}"),
        ("warmed after restart", f"{_int(server.get('warmed_blocks'))} blocks, {_size(server.get('warmed_bytes'))}"),
        ("connections", _int(server.get("open_connections"))),
    ]  # fmt: skip
    for name, value in rows:
        table.add_row(name, value)
    return table


def _latencies(latency: dict[str, dict[str, float]]) -> Table:
    table = Table(title="operations (us)", title_justify="left")
    for column in ("op", "count", "mean", "p50", "p99"):
        table.add_column(column, justify="left" if column == "op" else "right")
    for op, row in sorted(latency.items()):
        table.add_row(
            op,
            _int(row["count"]),
            f"{row['mean_us']:,.0f}",
            f"<= {row['p50_us']:,.0f}",
            f"<= {row['p99_us']:,.0f}",
        )
    return table


def _hit_lengths(buckets: dict[str, int]) -> Table:
    table = Table(title="hit lengths (tokens)", title_justify="left")
    table.add_column("up to", justify="right")
    table.add_column("prompts", justify="right")
    for bound, count in buckets.items():
        if count:
            table.add_row(bound if bound != "+Inf" else "more", _int(count))
    return table


def _tenants(tenants: dict[str, dict[str, float]]) -> Table:
    table = Table(title="tenants", title_justify="left")
    columns = ("tenant", "stored", "blocks", "hit tokens", "saved s", *_REASONS)
    for column in columns:
        table.add_column(column, justify="left" if column == "tenant" else "right")
    for tenant, values in sorted(tenants.items()):
        table.add_row(
            tenant or "(unknown)",
            _size(values.get("stored_bytes")),
            _int(values.get("stored_blocks")),
            _int(values.get("hit_tokens")),
            f"{values.get('prefill_saved_seconds', 0.0):,.1f}",
            *(_int(values.get(f"{reason}_blocks")) for reason in _REASONS),
        )
    return table


def _pct(value: float | None) -> str:
    return f"{100 * (value or 0.0):.1f}%"


def _int(value: float | None) -> str:
    return f"{int(value or 0):,}"


def _size(value: float | None) -> str:
    size = float(value or 0)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{size:,.1f} TiB"
