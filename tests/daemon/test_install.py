"""The package as a release ships it: an sdist and a wheel built from this tree, the wheel installed
with its dependencies into a fresh venv without torch, and the installed `prefixd` command serving
puts and loads from the installed clients. Serving must not need torch (754 MB on CPU, gigabytes
with CUDA): it is the [gpu] extra, for prefixd.client.transfer only.

The build and the venv are made once per session (pip may fetch small packages; never torch: the
wheel's requirements are checked before anything is installed)."""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest

import prefixd

from .conftest import REPO, DaemonFactory

pytestmark = pytest.mark.slow

# Failure bounds for the steps that build or install (pip may download small packages).
BUILD_TIMEOUT_S = 600.0
RUN_TIMEOUT_S = 120.0

# What the installed package's clients do, run by the fresh venv's python: a put with the blocking
# client, a load of it with the asyncio one; it prints the torch modules it saw imported.
CLIENT_SCRIPT = """
import asyncio, sys
import numpy as np
import prefixd
from prefixd.client import AsyncClient, Client

assert prefixd.__file__.startswith(sys.prefix), prefixd.__file__
identity = prefixd.Identity(model="m", weights="w", tokenizer="t", template="c", rope="r",
                            kv_layout="bf16", block_tokens=4, tenant="a")
tokens = np.arange(3 * 4 + 2, dtype=np.uint32) * 7 + 500_000_000
payloads = [bytes([i + 1]) * (100 + i) for i in range(3)]
with Client(sys.argv[1], region_bytes=1 << 20) as client:
    assert client.put(identity, tokens, payloads).stored == 3

async def load() -> list[bytes]:
    async with AsyncClient(sys.argv[1], region_bytes=1 << 20) as client:
        loaded = await client.load(identity, tokens)
        return [bytes(view) for view in loaded.views]

assert asyncio.run(load()) == payloads
print("loaded", len(payloads), sorted(m for m in sys.modules if m.split(".")[0] == "torch"))
"""


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


@dataclass(frozen=True)
class Installed:
    venv: Path
    built: Built

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def prefixd(self) -> Path:
        return self.venv / "bin" / "prefixd"


def _env() -> dict[str, str]:
    """This environment without anything that would make a subprocess see this checkout or this
    venv instead of the one it runs in."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP"}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _run(
    command: list[str | Path], cwd: Path, timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _check(
    command: list[str | Path], cwd: Path, timeout: float = RUN_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    done = _run(command, cwd, timeout)
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done


def _wheel_metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        return email.message_from_bytes(archive.read(name))


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """The sdist (`python -m build --sdist`, build isolation as a release has it) of a copy of
    this tree, and the wheel pip builds from that sdist: what the wheel holds came through it."""
    work = tmp_path_factory.mktemp("build")
    source = work / "src"
    # A copy, so the build's build/ and egg-info never land in the checkout others work in.
    shutil.copytree(
        REPO,
        source,
        ignore=shutil.ignore_patterns(
            ".*", "build", "dist", "*.egg-info", "__pycache__", "results"
        ),
    )
    dist = work / "dist"
    python = sys.executable
    _check([python, "-m", "build", "--sdist", "--outdir", dist, source], work, BUILD_TIMEOUT_S)
    (sdist,) = dist.glob("prefixd-*.tar.gz")
    pip_wheel = ["-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist), str(sdist)]
    _check([python, *pip_wheel], work, BUILD_TIMEOUT_S)
    (wheel,) = dist.glob("prefixd-*.whl")
    return Built(sdist, wheel)


@pytest.fixture(scope="session")
def installed(built: Built, tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """A fresh venv with the wheel and its dependencies, and no torch."""
    requirements = _wheel_metadata(built.wheel).get_all("Requires-Dist") or []
    unconditional = [r for r in requirements if ";" not in r]
    # Checked before installing: a base requirement on torch would download gigabytes.
    assert not [r for r in unconditional if r.startswith("torch")], unconditional
    venv = tmp_path_factory.mktemp("venv") / "base"
    work = venv.parent
    _check([sys.executable, "-m", "venv", venv], work)
    pip = ["-m", "pip", "install", "--quiet", str(built.wheel)]
    _check([venv / "bin" / "python", *pip], work, BUILD_TIMEOUT_S)
    return Installed(venv, built)


def test_sdist_and_wheel_carry_license_units_and_docs_and_one_version(built: Built) -> None:
    with tarfile.open(built.sdist) as sdist:
        root = f"prefixd-{prefixd.__version__}"
        members = {name.removeprefix(f"{root}/") for name in sdist.getnames()}
    for path in ("LICENSE", "README.md", "docs/protocol.md", "docs/events.md"):
        assert path in members, sorted(members)
    assert {"systemd/prefixd.service", "systemd/prefixd.socket"} <= members, sorted(members)

    with zipfile.ZipFile(built.wheel) as wheel:
        names = set(wheel.namelist())
    data = f"prefixd-{prefixd.__version__}.data/data/share"
    for path in ("doc/prefixd/README.md", "doc/prefixd/LICENSE", "doc/prefixd/protocol.md"):
        assert f"{data}/{path}" in names, sorted(names)
    for unit in ("prefixd.service", "prefixd.socket"):
        assert f"{data}/prefixd/systemd/{unit}" in names, sorted(names)

    metadata = _wheel_metadata(built.wheel)
    assert metadata["Version"] == prefixd.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Typing :: Typed" in (metadata.get_all("Classifier") or [])
    assert {"gpu", "transformers", "test"} <= set(metadata.get_all("Provides-Extra") or [])
    torch_requirements = [r for r in metadata.get_all("Requires-Dist") or [] if "torch" in r]
    assert torch_requirements and all("extra ==" in r for r in torch_requirements)
    assert 'torch>=2.4; extra == "gpu"' in torch_requirements, torch_requirements


def test_base_install_serves_puts_and_loads_without_torch(
    installed: Installed, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    no_torch = _run([installed.python, "-c", "import torch"], tmp_path)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr

    version = _check([installed.prefixd, "--version"], tmp_path)
    assert version.stdout.strip() == f"prefixd {prefixd.__version__}"

    daemon = daemon_factory(launcher=[str(installed.prefixd)])
    cmdline = Path(f"/proc/{daemon.pid}/cmdline").read_bytes().split(b"\0")
    assert cmdline[1] == os.fsencode(installed.prefixd), cmdline  # the venv's python runs it
    client = _check([installed.python, "-c", CLIENT_SCRIPT, daemon.socket], tmp_path)
    assert client.stdout.split("\n")[-2] == "loaded 3 []", client.stdout
    health = _check([installed.prefixd, "health", "--socket", daemon.socket], tmp_path)
    assert health.stdout.strip(), health
    maps = Path(f"/proc/{daemon.pid}/maps").read_text()
    assert "torch" not in maps
    assert daemon.stop() == 0, daemon.log()


def test_without_torch_the_extras_are_named(installed: Installed, tmp_path: Path) -> None:
    failed = _run([installed.python, "-c", "import prefixd.client.transfer"], tmp_path)
    assert failed.returncode != 0
    assert "prefixd[gpu]" in failed.stderr, failed.stderr
    integration = [installed.python, "-c", "import prefixd.integrations.transformers"]
    failed = _run(integration, tmp_path)
    assert failed.returncode != 0
    assert "prefixd[transformers]" in failed.stderr, failed.stderr
    # Everything that serves imports without it.
    imports = "import prefixd.cli, prefixd.client, prefixd.client.aio, prefixd.daemon.server"
    _check([installed.python, "-c", imports], tmp_path)


def test_installed_docs_and_units_land_under_the_prefix(installed: Installed) -> None:
    docs = installed.venv / "share" / "doc" / "prefixd"
    for name in ("README.md", "LICENSE", "protocol.md", "events.md"):
        assert (docs / name).is_file(), sorted(p.name for p in docs.glob("*"))
    units = installed.venv / "share" / "prefixd" / "systemd"
    service = units / "prefixd.service"
    assert service.is_file() and (units / "prefixd.socket").is_file()
    assert service.read_bytes() == (REPO / "systemd" / "prefixd.service").read_bytes()
    # The unit's Documentation= file paths exist under an install's prefix (<prefix>/share/...).
    urls = [
        url
        for line in service.read_text().splitlines()
        if line.startswith("Documentation=")
        for url in line.removeprefix("Documentation=").split()
    ]
    files = [url.removeprefix("file://") for url in urls if url.startswith("file://")]
    for path in files:
        assert "/share/" in path, path
        assert (installed.venv / "share" / path.split("/share/", 1)[1]).is_file(), path
