"""The benchmarks' daemon runs the prefixd its bench imported, wherever the bench was started:
an A/B run that puts another revision first on PYTHONPATH measures that revision's daemon, not a
`prefixd` that `python -m` finds in the working directory."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


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
