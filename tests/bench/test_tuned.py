"""bench/tuned.py: a benchmark sets knobs serve no longer lists (here the frame limit, which hello
reports, and the eviction order) on serve's own daemon, without the deprecated flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixd.errors import ConfigError
from tests.daemon.conftest import Raw

ROOT = Path(__file__).resolve().parents[2]


def test_knobs_reach_the_daemon_without_a_deprecation_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from suitelib import SuiteDaemon  # a bench module: bench/ is on the path now

    knobs = ["max_frame_bytes=8KiB", "eviction=lru"]
    with SuiteDaemon(tmp_path, "tuned", knobs=knobs) as daemon, Raw(daemon.socket) as raw:
        assert raw.hello()["max_frame_bytes"] == 8 << 10
        command = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().split(b"\0")
    assert command[1].endswith(b"bench/tuned.py") and b"--data-dir" in command
    assert "deprecated" not in daemon.log_path.read_text()


def test_a_misspelt_knob_is_refused_naming_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import tuned

    with pytest.raises(ConfigError, match="did you mean eviction"):
        tuned.main(["evicton=lru", "--", "--data-dir", "/nonexistent"])
