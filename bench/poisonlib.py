"""What the poison suite reports: for each silent-wrong-KV failure a peer has had, what prefixd
served and what the peer's own storage served in the same scenario, judged against the bytes the
scenario stored (or the output the engine computes without any cache).

A scenario module (bench/poison_<engine>.py) has `rows() -> list[Row]` and, run as a script,
prints them through `main` (`--json`: one JSON list); tests/poison/ asserts prefixd's column of
every row.
bench/poison.py runs every module in its engine's venv and prints one table.
"""

from __future__ import annotations

import argparse
import json
import mmap
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np

# exact: served the right state (or the engine's output equals the output without a cache);
# miss: served nothing (the engine recomputes); wrong: served other bytes, silently;
# n/a: the peer has no storage that runs here for this scenario.
Outcome = Literal["exact", "miss", "wrong", "n/a"]
SAFE: frozenset[str] = frozenset({"exact", "miss"})


@dataclass(frozen=True)
class Row:
    scenario: str  # what changed, in a few words
    where: str  # the peer's issue or pull request that reported the failure
    prefixd: Outcome
    peer: Outcome
    peer_storage: str  # which storage of the peer ran the same scenario ("" when n/a)


def judge(expected: bytes | np.ndarray | None, served: bytes | np.ndarray | None) -> Outcome:
    """`served` against the bytes a correct cache would give (`expected` None: any served bytes
    are wrong, as when the scenario changed what the stored state means)."""
    if served is None:
        return "miss"
    if expected is None:
        return "wrong"
    want = np.frombuffer(memoryview(expected).cast("B"), dtype=np.uint8)
    got = np.frombuffer(memoryview(served).cast("B"), dtype=np.uint8)
    return "exact" if want.shape == got.shape and bool((want == got).all()) else "wrong"


def files_under(path: Path) -> Callable[[], list[Path]]:
    """The files a storage keeps under `path`, listed when called."""
    return lambda: sorted(each for each in path.rglob("*") if each.is_file())


def store_files(data_dir: Path) -> Callable[[], list[Path]]:
    """The file a prefixd daemon whose store is `data_dir` keeps its blocks in."""
    return lambda: [data_dir / "data.mdb"]


def rot(files: Iterable[Path], payload: bytes) -> None:
    """Flip one byte in the middle of `payload` wherever it lies in `files`, in place (a running
    daemon maps its file), as a bad sector would; the payload must lie somewhere."""
    needle = payload[len(payload) // 2 - 32 : len(payload) // 2 + 32]
    found = 0
    for path in files:
        if not path.stat().st_size:
            continue  # nothing to map
        with open(path, "r+b") as file, mmap.mmap(file.fileno(), 0) as data:
            at = data.find(needle)
            while at >= 0:
                data[at + 32] ^= 0x5A
                found += 1
                at = data.find(needle, at + 1)
    if not found:
        raise AssertionError("the stored payload to damage is in none of the storage's files")


def print_rows(rows: Sequence[Row], as_json: bool) -> None:
    if as_json:
        print(json.dumps([asdict(row) for row in rows]))
        return
    print("| scenario | reported in | prefixd | the peer's storage |")
    print("|---|---|---|---|")
    for row in rows:
        peer = f"{row.peer} ({row.peer_storage})" if row.peer_storage else row.peer
        print(f"| {row.scenario} | {row.where} | {row.prefixd} | {peer} |")


def main(rows: Callable[[], Sequence[Row]], doc: str | None) -> None:
    """A scenario module's command line: its rows as a table, or with --json as one JSON list."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--json", action="store_true")
    print_rows(rows(), parser.parse_args().json)
