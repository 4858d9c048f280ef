"""SGLang's own file backend (HiCacheFile) and prefixd behind the same HiCache interface, in one run.

Run in the SGLang venv (.ci/sglang-venv), from the repository root:

    .venv-sglang/bin/python bench/sglang_backend.py [--json] [--pages N] [--repeat R]

Both backends are made by SGLang's `StorageBackendFactory.create_backend("dynamic", ...)` over a
real CPU host pool (`MHATokenToKVPoolHost`, page-first, bf16) and driven by SGLang's own
controller methods (tests/integrations/sglang/harness.py): `_page_backup` stores `--pages` pages,
then a fresh controller over an empty host pool runs the hit query and `_page_transfer` into it.
GB/s from the first call to the last page in place (the pages are compared after the clock
stops), median of `--repeat` rounds of new prompts; memcpy of the same bytes for scale. HiCacheFile
has no v1 (host-index) path, so it runs through v0 (flat page tensors); prefixd runs through v0 and
v1. HiCacheFile writes with `tofile` and no fsync; prefixd's daemon runs its default durability
(`periodic`). Loads are warm for both (the files and the daemon's LMDB are in the page cache).

Then what survives: the daemon is restarted (HiCacheFile's directory is reopened by a new
backend), and each is asked by (a) the same engine, (b) an engine serving other weights of the
same model name, (c) the same engine after one byte of one stored page was flipped on disk: how
many pages each hit query reports, how many the transfer loads, and whether they are the bytes
stored.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from tests.integrations.sglang.standin import install

install()  # sglang's model configs import torchvision (see the stand-in's docstring)

import torch
from poisonlib import files_under, rot
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from suitelib import SuiteDaemon

from tests.integrations.sglang import harness
from tests.integrations.sglang.harness import Controller, file_extra, fill, pages_of

PAGE = harness.PAGE
LAYERS, HEADS, HEAD_DIM = 8, 8, 128  # bf16: 32 KiB of KV per token, 512 KiB per 16-token page


def pool(pages: int) -> MHATokenToKVPoolHost:
    device = MHATokenToKVPool(
        pages * PAGE,
        PAGE,
        torch.bfloat16,
        HEADS,
        HEAD_DIM,
        LAYERS,
        "cpu",
        False,
        start_layer=0,
        end_layer=LAYERS,
    )
    return MHATokenToKVPoolHost(
        device.get_device_pool_infos()[0].buffer_info,
        1.0,
        0,
        PAGE,
        "page_first",
        pin_memory=False,
        device_capacity_tokens=device.size,
        start_layer=0,
        end_layer=LAYERS,
        write_back_staging=device.hicache_write_back_staging,
    )


def tokens_of(pages: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 32000, (pages * PAGE,), generator=generator).tolist()


def memcpy_s(n_bytes: int) -> float:
    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.ones(n_bytes, dtype=np.uint8)
    started = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - started


def store(extra: dict[str, Any], pages: int, seed: int) -> tuple[list[int], list[bytes], float]:
    writer = Controller(pool(pages), extra)
    tokens = tokens_of(pages, seed)
    slots = writer.pool.alloc(pages * PAGE)
    fill(writer.pool, slots, seed)
    started = time.perf_counter()
    stored = writer.backup(tokens, slots)
    seconds = time.perf_counter() - started
    assert stored == pages * PAGE, f"stored {stored} of {pages * PAGE} tokens"
    expected = pages_of(writer.pool, slots)
    writer.close()
    return tokens, expected, seconds


def read(extra: dict[str, Any], tokens: list[int], pages: int) -> tuple[int, list[bytes], float]:
    """A fresh controller's hit query and transfer: pages reported, the pages loaded, and the
    transfer's seconds."""
    reader = Controller(pool(pages), extra)
    slots = reader.pool.alloc(pages * PAGE)
    hit = reader.hit(tokens) // PAGE
    started = time.perf_counter()
    loaded = reader.prefetch(tokens, slots) // PAGE
    seconds = time.perf_counter() - started
    got = pages_of(reader.pool, slots[: loaded * PAGE])
    reader.close()
    return hit, got, seconds


def load(extra: dict[str, Any], tokens: list[int], expected: list[bytes]) -> dict[str, Any]:
    """A fresh controller's hit query and transfer: pages reported, loaded, and byte-correct."""
    hit, got, seconds = read(extra, tokens, len(expected))
    correct = sum(1 for a, b in zip(got, expected) if a == b)
    return {"hit": hit, "loaded": len(got), "correct": correct, "seconds": seconds}


def bench(root: Path, pages: int, repeat: int) -> dict[str, Any]:
    daemon = SuiteDaemon(root, "prefixd", map_size=max(8 << 30, 4 * pages * (512 << 10) * repeat))
    daemon.start()
    page_bytes = pool(1).get_dummy_flat_data_page().nbytes
    n_bytes = pages * page_bytes
    region = n_bytes + (1 << 20)
    backends = {
        "file": lambda: file_extra(root / "hicache"),
        "prefixd_v0": lambda: harness.prefixd_extra(
            daemon.socket, interface_v1=0, region_bytes=region
        ),
        "prefixd_v1": lambda: harness.prefixd_extra(
            daemon.socket, interface_v1=1, region_bytes=region
        ),
    }
    report: dict[str, Any] = {"pages": pages, "page_bytes": page_bytes, "bytes": n_bytes}
    times: dict[str, list[float]] = {f"{n}_{op}": [] for n in backends for op in ("store", "load")}
    times["memcpy"] = []
    kept: dict[str, tuple[list[int], list[bytes]]] = {}
    try:
        for r in range(repeat + 1):  # round 0 warms up
            for i, (name, extra) in enumerate(backends.items()):
                tokens, expected, stored_s = store(extra(), pages, seed=100 * r + i)
                loaded = load(extra(), tokens, expected)
                assert loaded["correct"] == pages, f"{name}: {loaded}"
                if r:
                    times[f"{name}_store"].append(stored_s)
                    times[f"{name}_load"].append(loaded["seconds"])
                kept[name] = (tokens, expected)
            if r:
                times["memcpy"].append(memcpy_s(n_bytes))
        for key, samples in times.items():
            report[f"{key}_gbps"] = round(n_bytes / statistics.median(samples) / 1e9, 3)

        # what survives: a restart, another engine's weights, one flipped byte
        daemon.restart()
        survives: dict[str, Any] = {}
        for name in ("file", "prefixd_v1"):
            tokens, expected = kept[name]
            extra = backends[name]()
            other = {**extra, "weights": "rev=other-weights"}  # the file backend ignores it
            survives[name] = {
                "after_restart": load(extra, tokens, expected),
                "other_weights": load(other, tokens, expected),
            }
        daemon.stop()
        for name, where in (("file", root / "hicache"), ("prefixd_v1", daemon.data_dir)):
            rot(files_under(where)(), kept[name][1][pages // 2])
        daemon.restart(stopped=True)
        for name in ("file", "prefixd_v1"):
            survives[name]["one_byte_flipped"] = load(backends[name](), *kept[name])
        for result in survives.values():
            for case in result.values():
                case.pop("seconds")
        report["survives"] = survives
    finally:
        daemon.stop()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=256, help="pages stored and loaded per round")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": f"{platform.node()} {os.cpu_count()} cpus, {platform.python_version()}",
        "command": " ".join(sys.argv),
    }
    with tempfile.TemporaryDirectory(prefix="sglang-backend-") as tmp:
        report.update(bench(Path(tmp), args.pages, args.repeat))
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
