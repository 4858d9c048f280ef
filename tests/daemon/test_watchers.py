"""Model manifests: fingerprints, and retiring a model's old weights when its files change."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from prefixd import Identity
from prefixd.client import Client
from prefixd.config.settings import parse_manifests
from prefixd.daemon import watchers
from prefixd.daemon.watchers import ManifestWatcher, fingerprint

from ..waiting import settle
from .conftest import DaemonFactory, wait_for

PROMPT = np.arange(100, 112, dtype=np.uint32)


def test_fingerprint_follows_names_and_bytes(tmp_path: Path) -> None:
    config, index = tmp_path / "config.json", tmp_path / "index.json"
    config.write_text('{"layers": 2}')
    index.write_text('{"weights": "a"}')
    first = asyncio.run(fingerprint((config, index)))
    assert first.startswith("sha256:") and first == asyncio.run(fingerprint((config, index)))
    index.write_text('{"weights": "b"}')
    assert asyncio.run(fingerprint((config, index))) != first
    index.unlink()
    assert asyncio.run(fingerprint((config, index))) != first  # missing counts, never raises


def test_manifest_entries_are_checked() -> None:
    assert parse_manifests(("m=/a/b.json+/a/c.json",)) == {
        "m": (Path("/a/b.json"), Path("/a/c.json"))
    }
    for bad in ("m", "=/a", "m=", "m=relative.json"):
        with pytest.raises(ValueError):
            parse_manifests((bad,))
    with pytest.raises(ValueError, match="twice"):
        parse_manifests(("m=/a", "m=/b"))


def identity(weights: str) -> Identity:
    return Identity(
        model="m",
        weights=weights,
        tokenizer="t",
        template="c",
        rope="r",
        kv_layout="bf16",
        block_tokens=4,
        tenant="a",
    )


def test_a_changed_manifest_retires_the_old_weights(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "config.json").write_text('{"layers": 2}')
    (models / "index.json").write_text('{"shard": "v1"}')
    manifests = f"m={models / 'config.json'}+{models / 'index.json'}"
    daemon = daemon_factory("--model-manifests", manifests)
    with Client(daemon.socket, region_bytes=1 << 16) as client:
        first = client.server["models"]["m"]
        assert first == asyncio.run(fingerprint((models / "config.json", models / "index.json")))
        client.put(identity(first), PROMPT, [b"v1"] * 3)
        client.put(identity("some-other-weights"), PROMPT, [b"xx"] * 3)
        (models / "index.json").write_text('{"shard": "v2"}')  # new weights arrive
        wait_for(
            lambda: client.lookup(identity(first), [PROMPT])[0].n_blocks == 0,
            "the old weights retired",
        )
        assert client.lookup(identity("some-other-weights"), [PROMPT])[0].n_blocks == 0
        second = client.stats()["server"]["models"]["m"]
        assert second != first
        client.put(identity(second), PROMPT, [b"v2"] * 3)
        checks = client.stats()["server"]["manifest_checks"]
        (models / "index.json").write_text('{"shard": "v2"}')  # rewritten, the same bytes
        wait_for(
            lambda: client.stats()["server"]["manifest_checks"] > checks, "the manifest checked"
        )
        assert client.lookup(identity(second), [PROMPT])[0].n_blocks == 3  # the same: it stays
        client.put(identity("stale"), PROMPT, [b"st"] * 3)
    daemon.restart()  # a start retires whatever other versions were stored meanwhile
    with Client(daemon.socket) as client:
        assert client.lookup(identity("stale"), [PROMPT])[0].n_blocks == 0
        assert client.lookup(identity(second), [PROMPT])[0].n_blocks == 3
    assert daemon.stop() == 0


def test_a_refresh_the_files_changed_again_under_never_has_the_last_word(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights change twice in quick succession and the first refresh fingerprints slowly
    (gigabytes of weights): the watcher ends naming, and keeping, what the files hold last."""
    on_disk = ["v1"]
    first_read = asyncio.Event()
    slow = asyncio.Event()

    async def fingerprinted(paths: tuple[Path, ...]) -> str:
        seen = on_disk[0]
        if seen == "v2":  # read the files, then hash them for a while
            first_read.set()
            await slow.wait()
        return seen

    monkeypatch.setattr(watchers, "fingerprint", fingerprinted)
    kept: list[str] = []

    async def retire(model: str, keep: str) -> int:
        kept.append(keep)
        return 0

    async def run() -> ManifestWatcher:
        watcher = ManifestWatcher({"m": (tmp_path / "index.json",)}, retire)
        await watcher.start()
        on_disk[0] = "v2"
        watcher._spawn("m")
        await first_read.wait()
        on_disk[0] = "v3"
        watcher._spawn("m")  # its first step runs before the first refresh wakes: scheduled first
        slow.set()
        await settle(lambda: watcher.checks == 2, "both refreshes done")
        await watcher.stop()
        return watcher

    watcher = asyncio.run(run())
    assert watcher.fingerprints["m"] == "v3"
    assert kept == ["v1", "v3"]  # never in favour of v2, gone from disk
