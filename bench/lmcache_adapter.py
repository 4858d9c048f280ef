"""prefixd behind LMCache's L2 adapter interface, against LMCache's own filesystem adapter, in one run.

Run in the vLLM venv with lmcache added (.ci/vllm-venv, .ci/lmcache-venv), from the repository root:

    .venv-vllm/bin/python bench/lmcache_adapter.py [--json] [--objects 64] [--object-mib 4]

Both adapters are built by LMCache's own config parser and plugin factory from the `--l2-adapter`
JSON a node server gets (`{"type": "fs", "base_path": ...}` and prefixd's plugin), and driven the
way LMCache's controllers drive them (submit, wait on the event fd, collect once):

* `store_gbps` / `load_gbps`: `--objects` memory objects of `--object-mib` each, stored in one task
  (after a `sync`: no store waits on the other adapter's unwritten pages), then locked and loaded in
  one task into fresh memory objects, touched first as the node server's pinned L1 memory is (every
  byte compared after the clock stops), median of `--repeat` rounds on fresh keys. The limits, on
  the same bytes, each the best of 3: `memcpy_gbps`, one copy between two touched buffers;
  `read_gbps`, each object read from a file in the page cache into touched memory (what the fs
  adapter does); `read_checksum_gbps`, the same with the crc32c taken as each MiB arrives (what
  prefixd's daemon does before the adapter's copy into the memory object).
* `after_restart`: the adapter closed and built again on the same directory (and, for prefixd, the
  daemon restarted): how many of the stored keys a lookup finds, and how many load byte-exact.
* `after_damage`: one byte flipped in one stored object on disk (the fs adapter's file, prefixd's
  LMDB chunk), then a fresh adapter loads every key: loads that returned the stored bytes, misses,
  and loads that "succeeded" with other bytes (served damaged KV).
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
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import crc32c
import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from benchlib import gbps, timed, touched_buffer
from suitelib import SuiteDaemon

from prefixd import Store
from prefixd.integrations.lmcache import l2_adapter_config
from prefixd.schema.chain import chain_hashes
from tests.integrations.lmcache.harness import (
    keys,
    load,
    lookup_and_lock,
    memory_obj,
    payload_objs,
    store,
    uint8_layout,
)
from tests.store.test_faults import corrupt_stored_chunk

MiB = 1 << 20


def build(spec: dict[str, Any]) -> Any:
    """An adapter the way the node server builds one from its `--l2-adapter` JSON."""
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry

    parser = argparse.ArgumentParser()
    add_l2_adapters_args(parser)
    config = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)]))
    return create_l2_adapter_from_registry(config.adapters[0])


def memcpy_gbps(n_bytes: int) -> float:
    """One copy between two touched buffers, the best of 3."""
    src, dst = touched_buffer(n_bytes), touched_buffer(n_bytes)
    return gbps(n_bytes, min(timed(partial(np.copyto, dst, src))[0] for _ in range(3)))


def page_cache_reads(root: Path, n_objects: int, size: int) -> tuple[float, float]:
    """GB/s of reading `n_objects` objects of `size` from a file in the page cache into touched
    memory, without and with a crc32c taken per MiB read (best of 3 each)."""
    path = root / "limits"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, n_objects * size, np.uint8).data)
    dest = memoryview(touched_buffer(n_objects * size))  # each object in a place of its own
    fd = os.open(path, os.O_RDONLY)

    def read(checksum: bool) -> None:
        for at in range(0, n_objects * size, size):
            for piece in range(0, size, MiB):
                target = dest[at + piece : at + piece + MiB]
                os.preadv(fd, [target], at + piece)
                if checksum:
                    crc32c.crc32c(target)

    try:
        read(False)  # into the page cache
        plain = min(timed(partial(read, False))[0] for _ in range(3))
        checked = min(timed(partial(read, True))[0] for _ in range(3))
    finally:
        os.close(fd)
        path.unlink()
    return gbps(n_objects * size, plain), gbps(n_objects * size, checked)


def rounds(adapter: Any, args: argparse.Namespace) -> tuple[list[float], list[float], bool]:
    size = args.object_mib * MiB
    total = args.objects * size
    store_gbps, load_gbps, exact = [], [], True
    for r in range(args.repeat):
        ks = keys(args.objects, start=10_000 * (r + 1))
        objs = payload_objs(args.objects, size, seed=r)
        os.sync()  # no store starts behind the other adapter's (or its own) unwritten pages
        started = time.perf_counter()
        result = store(adapter, ks, objs)
        store_gbps.append(total / (time.perf_counter() - started) / 1e9)
        assert result.is_successful(), "store failed"
        assert all(lookup_and_lock(adapter, ks, uint8_layout(size))), "stored keys not found"
        # touched before the clock starts: the node server's L1 memory is pinned, so resident
        outs = [memory_obj(size, fill=0) for _ in ks]
        started = time.perf_counter()
        bits = load(adapter, ks, outs)
        load_gbps.append(total / (time.perf_counter() - started) / 1e9)
        adapter.submit_unlock(ks)
        exact &= all(bits) and all(
            bytes(o.byte_array) == bytes(p.byte_array) for o, p in zip(outs, objs)
        )
    return store_gbps, load_gbps, exact


def fetch(adapter: Any, ks: list[Any], size: int) -> tuple[list[bool], list[bytes | None]]:
    """As a node server reads keys: lookup and lock (with the objects' layout), load into fresh
    objects of `size`, unlock. Which keys the lookup found, and each key's loaded bytes (None:
    the load missed)."""
    found = lookup_and_lock(adapter, ks, uint8_layout(size))
    outs = [memory_obj(size, fill=0) for _ in ks]
    bits = load(adapter, ks, outs)
    adapter.submit_unlock([k for k, hit in zip(ks, found) if hit])
    return found, [bytes(o.byte_array) if b else None for b, o in zip(bits, outs)]


def survey(adapter: Any, ks: list[Any], expected: list[bytes], size: int) -> dict[str, int]:
    found, got = fetch(adapter, ks, size)
    return {
        "found": sum(found),
        "loaded_exact": sum(g == e for g, e in zip(got, expected)),
        "missed": sum(g is None for g in got),
        "served_wrong_bytes": sum(g is not None and g != e for g, e in zip(got, expected)),
    }


def measure(
    name: str,
    spec: Callable[[], dict[str, Any]],
    restart: Callable[[], None],
    damage: Callable[[list[Any]], None],
    args: argparse.Namespace,
) -> dict[str, Any]:
    size = args.object_mib * MiB
    adapter = build(spec())
    try:
        store_gbps, load_gbps, exact = rounds(adapter, args)
        kept = keys(8, start=1)
        kept_objs = payload_objs(8, size, seed=99)
        assert store(adapter, kept, kept_objs).is_successful()
        expected = [bytes(o.byte_array) for o in kept_objs]
    finally:
        adapter.close()
    restart()
    adapter = build(spec())
    try:
        after_restart = survey(adapter, kept, expected, size)
    finally:
        adapter.close()
    damage(kept)
    adapter = build(spec())
    try:
        after_damage = survey(adapter, kept, expected, size)
    finally:
        adapter.close()
    return {
        "adapter": name,
        "store_gbps": round(statistics.median(store_gbps), 3),
        "load_gbps": round(statistics.median(load_gbps), 3),
        "loads_exact": exact,
        "after_restart": after_restart,
        "after_damage": after_damage,
    }


def flip_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def compare(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """Both adapters measured on the same objects, with the limits, as one report."""
    fs_dir = root / "fs"
    fs_dir.mkdir()

    def fs_damage(kept: list[Any]) -> None:
        files = sorted(f for f in fs_dir.rglob("*") if f.is_file())
        flip_middle(files[0])

    fs = measure(
        "lmcache fs",
        lambda: {"type": "fs", "base_path": str(fs_dir)},
        lambda: None,
        fs_damage,
        args,
    )
    daemon = SuiteDaemon(root, "prefixd")
    daemon.start()
    try:
        weights = "sha256:bench"

        def start_again() -> None:
            daemon.notify_path.unlink(missing_ok=True)  # bound by the previous start
            daemon.start()

        def prefixd_damage(kept: list[Any]) -> None:
            daemon.stop()
            with Store.open(daemon.data_dir) as opened:
                blocks, _ = opened.list_blocks(tenant="lmcache")
                block = next(b for b in blocks if b.tokens[:32] == kept[0].chunk_hash)
                [damaged] = chain_hashes(block.identity, block.tokens)
            corrupt_stored_chunk(daemon.data_dir, damaged)
            start_again()

        def prefixd_restart() -> None:
            daemon.stop()
            start_again()

        ours = measure(
            "prefixd",
            lambda: l2_adapter_config(str(daemon.socket), weights=weights),
            prefixd_restart,
            prefixd_damage,
            args,
        )
    finally:
        daemon.close()
    read_gbps, read_checksum_gbps = page_cache_reads(root, args.objects, args.object_mib * MiB)
    return {
        "objects": args.objects,
        "object_mib": args.object_mib,
        "repeat": args.repeat,
        "memcpy_gbps": round(memcpy_gbps(args.objects * args.object_mib * MiB), 3),
        "read_gbps": round(read_gbps, 3),
        "read_checksum_gbps": round(read_checksum_gbps, 3),
        "machine": platform.processor() or platform.machine(),
        "results": [fs, ours],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--objects", type=int, default=64)
    p.add_argument("--object-mib", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="lmc-bench-") as tmp:  # GiBs: never left behind
        report = compare(args, Path(tmp))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{args.objects} objects of {args.object_mib} MiB, memcpy {report['memcpy_gbps']} "
            f"GB/s, read {report['read_gbps']} GB/s, read and checksum "
            f"{report['read_checksum_gbps']} GB/s"
        )
        for r in report["results"]:
            print(
                f"{r['adapter']:>11}: store {r['store_gbps']} GB/s, load {r['load_gbps']} GB/s, "
                f"exact {r['loads_exact']}; after restart {r['after_restart']}; "
                f"after damage {r['after_damage']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
