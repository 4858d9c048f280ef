"""The benchmarks' daemon runs the prefixd its bench imported, wherever the bench was started:
an A/B run that puts another revision first on PYTHONPATH measures that revision's daemon, not a
`prefixd` that `python -m` finds in the working directory. daemon_bench reports every request
kind it times."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.benches import ROOT, run_bench


def test_the_daemon_ignores_a_prefixd_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoy = tmp_path / "cwd" / "prefixd"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text('raise SystemExit("the prefixd in the working directory")\n')
    monkeypatch.chdir(decoy.parent)
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from suitelib import SuiteDaemon  # a bench module: bench/ is on the path now

    # started means READY=1 came and a hello was answered: the decoy would have exited at once
    with SuiteDaemon(tmp_path, "daemon") as daemon:
        command = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().split(b"\0")
    assert command[1:4] == [b"-m", b"prefixd", b"serve"]


def test_a_run_reports_what_a_load_of_one_block_costs(tmp_path: Path) -> None:
    """A small run reports the one-block load beside the lookups, interleaved with them: the
    per-request cost of a load, which the throughput figure of one large load hides."""
    report = run_bench(
        "daemon_bench.py",
        *("--json", "--size-mib", "4", "--repeat", "1", "--lookups", "20"),
        *("--dir", str(tmp_path / "work")),
        timeout_s=600,
    )
    latency = report["latency_us"]
    assert set(latency) >= {"lookup", "health", "hello", "load_block"}
    assert report["load_block_p50_us"] == latency["load_block"]["p50"] > 0
