"""What the daemon measures: hit rates at three levels, hit lengths, stage times, per-tenant
totals, the benefit model, and the Prometheus exposition (its names, its bounded tenant labels,
the textfile node_exporter reads); never a prompt, token id or key."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

import prefixd
from prefixd.client import Client
from prefixd.daemon.metrics import MAX_TENANT_LABELS, OTHER_TENANTS
from prefixd.schema import SCHEMA_VERSION

from .conftest import (
    DEADLINE_S,
    IDENTITY,
    REPO,
    Daemon,
    DaemonFactory,
    make_identity,
    payload,
    wait_for,
)

BT = IDENTITY.block_tokens
SIZE = 1000
# The console script pip installed: what an operator runs (tests elsewhere use python -m prefixd)
INSTALLED = [str(Path(sys.executable).with_name("prefixd"))]


def tokens(n: int, seed: int = 1) -> np.ndarray:
    return (np.arange(n, dtype=np.uint32) * 11 + seed * 1_000_003 + 700_000_000).astype(np.uint32)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port: int) -> str:
    url = f"http://127.0.0.1:{port}/metrics"
    with urllib.request.urlopen(url, timeout=DEADLINE_S) as response:
        text: str = response.read().decode()
    return text


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named `name` in an exposition, by their sorted labels."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def run_workload(daemon: Daemon) -> tuple[np.ndarray, np.ndarray]:
    """Store 8 blocks; look up the stored prompt (hit 8 blocks), a half-shared one (hit 4 of 8)
    and a miss (0 of 8); load the stored prompt once."""
    stored = tokens(8 * BT)
    half = np.concatenate([stored[: 4 * BT], tokens(4 * BT, seed=2)])
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(IDENTITY, stored, [payload(1, i, SIZE) for i in range(8)])
        client.lookup(IDENTITY, [stored, half, tokens(8 * BT, seed=3)])
        client.load(IDENTITY, stored)
    return stored, half


def test_hit_rates_lengths_times_and_tenants(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--prefill-tokens-per-s", "1000")
    run_workload(daemon)
    other = make_identity(tenant="b")
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        client.put(other, tokens(2 * BT, seed=4), [b"x" * 10, b"y" * 10])
        metrics = client.stats()["metrics"]
    rates = metrics["hit_rate"]
    assert rates["requests"] == round(2 / 3, 6)
    assert rates["tokens"] == 12 / 24
    # bytes: the miss's blocks are estimated at the identity's bytes per token (SIZE per block)
    assert rates["bytes"] == 12 * SIZE / (24 * SIZE)
    lengths = metrics["hit_length_tokens"]
    assert sum(lengths.values()) == 3 and lengths["0.0"] == 1
    assert set(metrics["latency_us"]) >= {"hello", "attach", "put", "lookup", "load"}
    assert metrics["latency_us"]["lookup"]["count"] == 1
    totals = metrics["totals"]
    assert totals["loaded_tokens"] == 8 * BT and totals["loaded_bytes"] == 8 * SIZE
    assert totals["prefill_saved_seconds"] == 8 * BT / 1000
    tenants = metrics["tenants"]
    assert tenants["a"]["stored_blocks"] == 8 and tenants["a"]["stored_bytes"] == 8 * SIZE
    assert tenants["b"]["stored_blocks"] == 2 and tenants["b"]["put_blocks"] == 2


def test_lookup_offers_only_hits_worth_loading(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory("--min-reusable-tokens", str(6 * BT))
    stored, half = run_workload(daemon)
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        reply = client.call(
            {
                "op": "lookup",
                "identity": IDENTITY.to_dict(),
                "prompts": [{"tokens": stored.tobytes()}, {"tokens": half.tobytes()}],
            }
        )
        full, short = reply["results"]
        assert full["n_tokens"] == 8 * BT and short["n_tokens"] == 0  # 4 blocks: below 6
        assert full["est_load_s"] > 0 and full["est_prefill_s"] > 0
        assert full["withheld_tokens"] == 0
        # the estimates are the hit's found; its tokens are held back, below the floor
        assert short["withheld_tokens"] == 4 * BT and short["est_prefill_s"] > 0
        assert client.load(IDENTITY, half).n_blocks == 0
        assert client.load(IDENTITY, stored).n_blocks == 8


def test_prometheus_endpoint_and_textfile(daemon_factory: DaemonFactory, tmp_path) -> None:
    port = free_port()
    textfile = tmp_path / "metrics" / "prefixd.prom"
    daemon = daemon_factory(
        "--metrics-port", str(port), "--metrics-textfile", str(textfile),
        "--metrics-interval-s", "1",
    )  # fmt: skip
    stored, half = run_workload(daemon)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=DEADLINE_S) as response:
        text = response.read().decode()
    for name in (
        'prefixd_lookup_prompts_total{tenant="a"} 3.0',
        'prefixd_hit_tokens_total{tenant="a"} 48.0',
        "prefixd_operation_seconds_bucket",
        'prefixd_stored_blocks{tenant="a"} 8.0',
        "prefixd_hit_length_tokens_bucket",
        "prefixd_compression_ratio",
    ):
        assert name in text, name
    # no token id, hash or key in any label or value line
    assert not any(str(t) in text for t in np.concatenate([stored, half]))
    wait_for(
        lambda: textfile.exists() and "prefixd_lookup_prompts_total" in textfile.read_text(),
        "the textfile written",
    )
    assert daemon.stop() == 0
    assert 'prefixd_lookup_prompts_total{tenant="a"} 3.0' in textfile.read_text()


def test_stats_cli_prints_tables_json_and_watches(daemon: Daemon) -> None:
    run_workload(daemon)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFIXD_")}
    command = [sys.executable, "-m", "prefixd", "stats", "--socket", str(daemon.socket)]
    tables = subprocess.run(
        command, capture_output=True, text=True, timeout=DEADLINE_S, cwd=REPO, env=env, check=False
    )
    assert tables.returncode == 0, tables.stderr
    assert "hit rate" in tables.stdout and "66.7%" in tables.stdout and "lookup" in tables.stdout
    watching = subprocess.Popen(
        [*command, "--json", "--watch", "0.2"], stdout=subprocess.PIPE, text=True, cwd=REPO, env=env
    )
    lines: list[str] = []

    def read() -> None:
        assert watching.stdout is not None
        while line := watching.stdout.readline():
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        # Interrupted only once it watches (two refreshes printed), never while it starts up.
        wait_for(lambda: len(lines) >= 2 or watching.poll() is not None, "two refreshes")
        assert watching.poll() is None, lines
        watching.send_signal(signal.SIGINT)
        code = watching.wait(DEADLINE_S)
    finally:
        watching.kill()
        watching.wait()
    reader.join(DEADLINE_S)
    assert code == 130, code  # interrupted, as a user's Ctrl-C
    assert len(lines) >= 2 and all('"hit_rate"' in line for line in lines), lines


@pytest.mark.parametrize(
    ("flags", "mode"), [((), 0o640), (("--metrics-textfile-mode", "600"), 0o600)]
)
def test_the_textfile_is_never_readable_by_every_user(
    daemon_factory: DaemonFactory, tmp_path: Path, flags: tuple[str, ...], mode: int
) -> None:
    """The textfile names tenants: it is written with its mode from the start (the umask of
    the daemon would make it world-readable), never as a file another user could read."""
    import stat

    textfile = tmp_path / "metrics" / "prefixd.prom"
    textfile.parent.mkdir()
    textfile.write_text("old\n")
    os.chmod(textfile, 0o644)  # an older file's mode does not carry over either
    daemon = daemon_factory(
        "--metrics-textfile", str(textfile), "--metrics-interval-s", "1", *flags
    )
    run_workload(daemon)
    wait_for(lambda: "prefixd_lookup_prompts_total" in textfile.read_text(), "the textfile written")
    assert stat.S_IMODE(textfile.stat().st_mode) == mode
    assert daemon.stop() == 0
    assert stat.S_IMODE(textfile.stat().st_mode) == mode


def test_names_follow_prometheus_conventions(daemon_factory: DaemonFactory, tmp_path: Path) -> None:
    """Speeds in bytes per second (the base unit), not GB/s; prefixd_build_info; the process
    collector's process_* over HTTP, and not in the textfile (node_exporter serves its own
    process's under the same names and would refuse ours)."""
    assert Path(INSTALLED[0]).exists(), INSTALLED
    port = free_port()
    textfile = tmp_path / "prefixd.prom"
    daemon = daemon_factory(
        "--metrics-port", str(port), "--metrics-textfile", str(textfile),
        "--metrics-interval-s", "1", launcher=INSTALLED,
    )  # fmt: skip
    run_workload(daemon)
    text = scrape(port)
    assert "gbps" not in text.lower()
    for name in (
        "prefixd_compress_bytes_per_second",
        "prefixd_decompress_bytes_per_second",
        "prefixd_verify_copy_bytes_per_second",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "process_open_fds",
    ):
        assert samples(text, name), name
    # the load copied and verified 8 KB of payloads stored raw: a speed in bytes, not in GB
    assert samples(text, "prefixd_verify_copy_bytes_per_second")[()] > 1e5
    [(labels, value)] = samples(text, "prefixd_build_info").items()
    assert value == 1.0
    info = dict(labels)
    assert info["version"] == prefixd.__version__
    assert info["python_version"] == platform.python_version()
    assert info["schema_version"] == str(SCHEMA_VERSION)
    served = 'prefixd_lookup_prompts_total{tenant="a"} 3.0'
    wait_for(lambda: textfile.exists() and served in textfile.read_text(), "the textfile written")
    written = textfile.read_text()
    assert samples(written, "prefixd_build_info") and samples(written, "prefixd_stored_bytes")
    assert "process_" not in written


def test_hit_length_buckets_start_at_the_block_size(daemon_factory: DaemonFactory) -> None:
    """One block, two, four, ...: the workload's hits (4 and 8 blocks of 4 tokens) each land in
    a bucket of their own instead of all under the first bound (256 tokens, it was)."""
    port = free_port()
    daemon = daemon_factory("--metrics-port", str(port), launcher=INSTALLED)
    run_workload(daemon)
    buckets = {
        dict(labels)["le"]: value
        for labels, value in samples(scrape(port), "prefixd_hit_length_tokens_bucket").items()
    }
    bounds = [float(b) for b in buckets if b != "+Inf"]
    assert sorted(bounds)[:5] == [0.0, BT, 2 * BT, 4 * BT, 8 * BT]
    assert all(b == 2 * a for a, b in zip(sorted(bounds)[1:], sorted(bounds)[2:], strict=False))
    # cumulative: the miss, then the 4-block hit, then the 8-block one
    assert [buckets[repr(float(b))] for b in (0, BT, 2 * BT, 4 * BT, 8 * BT)] == [1, 1, 1, 2, 3]
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        lengths = client.stats()["metrics"]["hit_length_tokens"]
    assert lengths[repr(float(4 * BT))] == 1 and lengths[repr(float(8 * BT))] == 1


def test_stored_series_are_capped_like_the_counters(daemon_factory: DaemonFactory) -> None:
    """1,102 tenants gave 1,102 prefixd_stored_bytes and _blocks series each: now tenants past
    MAX_TENANT_LABELS share one label there too, the same tenants as in the counters."""
    port = free_port()
    daemon = daemon_factory("--metrics-port", str(port), launcher=INSTALLED)
    n_tenants = 1102
    with Client(daemon.socket, region_bytes=1 << 20) as client:
        for i in range(n_tenants):
            client.put(make_identity(tenant=f"t{i:04d}"), tokens(BT, seed=i), [b"z" * 10])
        listed = client.stats()["metrics"]["tenants"]
    # `prefixd stats` is no time series: it still names every tenant's store (lmcache lists them)
    assert all(listed[f"t{i:04d}"]["stored_blocks"] == 1 for i in range(n_tenants))
    text = scrape(port)
    stored = {dict(k)["tenant"]: v for k, v in samples(text, "prefixd_stored_bytes").items()}
    blocks = {dict(k)["tenant"]: v for k, v in samples(text, "prefixd_stored_blocks").items()}
    puts = {dict(k)["tenant"]: v for k, v in samples(text, "prefixd_put_blocks_total").items()}
    assert len(stored) == MAX_TENANT_LABELS + 1
    assert set(stored) == set(blocks) == set(puts)
    assert sum(blocks.values()) == n_tenants and sum(stored.values()) == 10 * n_tenants
    assert blocks[OTHER_TENANTS] == puts[OTHER_TENANTS] == n_tenants - MAX_TENANT_LABELS


def test_a_textfile_node_exporter_would_ignore_is_refused(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """node_exporter's textfile collector reads *.prom only: another name would never be
    scraped, so the daemon refuses it at start rather than write it every interval."""
    textfile = tmp_path / "prefixd.metrics"
    daemon = daemon_factory("--metrics-textfile", str(textfile), launcher=INSTALLED, wait=False)
    assert daemon.proc is not None
    proc = daemon.proc
    wait_for(
        lambda: proc.poll() is not None or any(b"READY=1" in m for m in daemon.since_start()),
        "the daemon refusing the textfile or serving",
    )
    assert proc.poll() not in (None, 0), daemon.log()
    assert "metrics_textfile" in daemon.log() and ".prom" in daemon.log(), daemon.log()
    assert not textfile.exists()
