"""The Grafana dashboard in examples/ asks only for metrics the daemon really serves: every name
in its PromQL (panel targets and template variables) is one a live exporter renders."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .conftest import REPO, DaemonFactory
from .test_metrics import INSTALLED, free_port, run_workload, scrape

DASHBOARD = REPO / "examples" / "grafana-dashboard.json"

_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGES = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_WORDS = re.compile(r"(?<![\w.$])[A-Za-z_:][\w:]*")
_KEYWORDS = {"bool", "and", "or", "unless", "offset", "inf", "nan"}
# The sample names a family of each type is written as.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: what is left once strings, label matchers,
    ranges and grouping clauses are gone, less functions (a name before "(") and keywords."""
    text = _STRINGS.sub('""', expr)
    for pattern in (_MATCHERS, _RANGES, _GROUPING):
        text = pattern.sub(" ", text)
    return {
        word.group()
        for word in _WORDS.finditer(text)
        if not text[word.end() :].lstrip().startswith("(") and word.group() not in _KEYWORDS
    }


def expressions(node: Any) -> Iterator[str]:
    """Every PromQL expression of the dashboard: targets' `expr` and the variables' queries
    (label_values(SELECTOR, LABEL): the selector)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr":
                yield value
            elif key == "definition" and value.startswith("label_values("):
                yield value.removeprefix("label_values(").rsplit(",", 1)[0]
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def rendered_names(exposition: str) -> set[str]:
    """Every sample name the exposition's families can carry (empty families included)."""
    names = set()
    for family in text_string_to_metric_families(exposition):
        names.add(family.name)
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ()))
        names.update(sample.name for sample in family.samples)
    return names


def test_the_dashboard_names_only_served_metrics(daemon_factory: DaemonFactory) -> None:
    tricky = (
        'histogram_quantile(0.99, sum by (le, op) (rate(a_bucket{job=~"$job", x="y(z)"}'
        "[$__rate_interval]))) / on (op) group_left () b_total offset 5m * 1e9 + scalar(c)"
    )
    assert metric_names(tricky) == {"a_bucket", "b_total", "c"}  # the check reads PromQL
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 36
    panels = dashboard["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["title"], panel
        assert panel["type"] == "row" or panel["targets"], panel["title"]
    port = free_port()
    daemon = daemon_factory("--metrics-port", str(port), launcher=INSTALLED)
    run_workload(daemon)
    served = rendered_names(scrape(port))
    asked: set[str] = set()
    for expr in expressions(dashboard):
        names = metric_names(expr)
        assert names, expr
        assert names <= served, (names - served, expr)
        asked |= names
    # What operators look at: hit rates, saved prefill, load bandwidth, p99 latencies, stored
    # bytes per tenant, evictions and quarantines.
    assert {
        "prefixd_lookup_hits_total",
        "prefixd_hit_tokens_total",
        "prefixd_prefill_saved_seconds_total",
        "prefixd_loaded_bytes_total",
        "prefixd_operation_seconds_bucket",
        "prefixd_stored_bytes",
        "prefixd_removed_blocks_total",
        "prefixd_quarantined_blocks_total",
    } <= asked


def test_a_panel_on_a_metric_the_daemon_does_not_serve_is_caught(
    daemon_factory: DaemonFactory,
) -> None:
    """The check itself: the old speed in GB/s is not served any more."""
    port = free_port()
    daemon_factory("--metrics-port", str(port), launcher=INSTALLED)
    served = rendered_names(scrape(port))
    assert not metric_names('prefixd_decompress_gbps{job=~"$job"}') <= served


def test_the_dashboard_file_is_where_the_docs_say() -> None:
    assert "examples/grafana-dashboard.json" in (REPO / "docs" / "metrics.md").read_text()
    assert DASHBOARD.exists()
