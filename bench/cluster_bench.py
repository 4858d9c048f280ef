"""The shared tier on Mooncake Store: what a remote hit costs against a local one.

Node A stores a prefix and publishes it to the tier; node B, cold, looks the prompt up (each block
is fetched from the tier, proven against its origin checksum, installed in B's store) and loads it.
In the same run, on the same bytes:

  remote_hit      B's lookup (fetch + prove + install) and load, GB/s of payload, the median of
                  the rounds after the first: B deletes each round's prompt after it, so the
                  next round installs into pages its store freed, as a full store that evicts
                  does (a node's usual state);
  remote_hit_first  the first round's remote hit, B's store growing into pages it never had
                  (on a VM whose host takes back freed memory, each new page costs a fault on
                  the host: see fresh_write);
  local_hit       the same load again on B, now local;
  mooncake_get    Mooncake's own `get` of the same objects, one at a time into one buffer
                  (prefixd's adapter, no proof, no install): what the tier alone delivers;
  mooncake_get_fresh  Mooncake's get of each object into memory of its own that nothing touched
                  before (all kept to the end), as a first round's install writes into pages the
                  store never had: what the tier delivers in the conditions of remote_hit_first;
  mooncake_batch_get  the same through Mooncake's batch get (32 objects a round trip), the
                  fastest way the tier has to deliver them;
  mooncake_put    Mooncake's own put of the same values under other keys, one at a time;
  fresh_write     the same number of bytes written into a new file beside the stores (page
                  cache only, no fsync): what installing them costs at the least, since a remote
                  hit puts bytes in the store that were in none of its pages before;
  remote_hit_stages_s  node B's own seconds fetching, proving and installing (the three
                  overlap), and in the read-through in all (its counters `remote_*_us`);
  remote_hit_inline   the remote hit with the tier's client in the daemon's own process
                  (bench/tuned.py's `cluster_client=inline`) instead of a child process (the default): what
                  the child process costs. Rounds of the two alternate.

Run: `python bench/cluster_bench.py [--json] [--size-mib 256] [--block-kib 1024] [--data-root DIR]`
(`--data-root /dev/shm` puts both stores in memory, to tell the disk's write path from the rest's
cost). Needs the
package `mooncake-transfer-engine-non-cuda` and Debian's libibverbs1 (see README).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from localmaster import LocalMaster, master_binary
from suitelib import SuiteDaemon, machine_info, ratio

from prefixd import Identity
from prefixd.client import Client
from prefixd.cluster.blocks import block_key
from prefixd.cluster.mooncake import SharedTier
from prefixd.schema.chain import BlockChain

BLOCK_TOKENS = 256
# node B's own seconds per stage of a remote hit (its bridge's counters): fetching from the tier,
# proving the values, installing them (the three overlap), and the read-through in all
STAGES = ("fetch", "prove", "install", "read")
SERVED = "served_staged"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--size-mib", type=int, default=256)
    parser.add_argument("--block-kib", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=4, help="rounds (the first apart)")
    parser.add_argument("--data-root", type=Path, default=None, help="where the stores live")
    args = parser.parse_args(argv)
    binary = master_binary()
    if binary is None:
        print("mooncake-transfer-engine-non-cuda is not installed", file=sys.stderr)
        return 2
    loadavg = tuple(float(x) for x in Path("/proc/loadavg").read_text().split()[:3])
    block = args.block_kib << 10
    n_blocks = (args.size_mib << 20) // block
    segment = max(64 << 20, 4 * n_blocks * block)
    with tempfile.TemporaryDirectory(prefix="pxd-cluster-", dir=args.data_root) as tmp:
        root = Path(tmp)
        master = LocalMaster(binary, root)
        master.start()
        flags = [
            "--cluster-master", master.master, "--cluster-metadata", master.metadata,
            "--cluster-segment-bytes", str(segment),
            "--prefill-tokens-per-s", "100",  # slow prefill: every fetch is worth it
        ]  # fmt: skip
        map_size = 4 * segment + (1 << 30)
        knobs = ["cluster_timeout_s=30"]
        inline = [*knobs, "cluster_client=inline"]
        try:
            with (
                SuiteDaemon(root, "a", map_size=map_size, extra=flags, knobs=knobs) as a,
                SuiteDaemon(root, "b", map_size=map_size, extra=flags, knobs=knobs) as b,
                SuiteDaemon(root, "a-inline", map_size=map_size, extra=flags, knobs=inline) as ai,
                SuiteDaemon(root, "b-inline", map_size=map_size, extra=flags, knobs=inline) as bi,
            ):
                results = run(
                    {"": (a, b), "_inline": (ai, bi)},
                    root,
                    master,
                    n_blocks,
                    block,
                    args.repeat,
                )
        finally:
            master.stop()
    report = {
        "machine": machine_info(loadavg),
        "settings": {
            "size_mib": args.size_mib,
            "block_kib": args.block_kib,
            "repeat": args.repeat,
            "data_root": str(args.data_root or tempfile.gettempdir()),
        },
        **results,
        "ratios": {
            "remote_hit_vs_local_hit": ratio(results["remote_hit_gbps"], results["local_hit_gbps"]),
            "remote_hit_vs_mooncake_get": ratio(
                results["remote_hit_gbps"], results["mooncake_get_gbps"]
            ),
            "remote_hit_first_vs_mooncake_get_fresh": ratio(
                results["remote_hit_first_gbps"], results["mooncake_get_fresh_gbps"]
            ),
            "remote_hit_vs_mooncake_batch_get": ratio(
                results["remote_hit_gbps"], results["mooncake_batch_get_gbps"]
            ),
            "remote_hit_vs_fresh_write": ratio(
                results["remote_hit_gbps"], results["fresh_write_gbps"]
            ),
            "remote_hit_child_vs_inline": ratio(
                results["remote_hit_gbps"], results["remote_hit_inline_gbps"]
            ),
        },
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key in (
            "remote_hit_gbps",
            "remote_hit_first_gbps",
            "remote_hit_inline_gbps",
            "local_hit_gbps",
            "mooncake_get_gbps",
            "mooncake_get_fresh_gbps",
            "mooncake_batch_get_gbps",
            "mooncake_put_gbps",
            "fresh_write_gbps",
        ):
            print(f"{key:24} {report[key]:8.3f}")
        for key in ("remote_hit_stages_s", "remote_hit_inline_stages_s"):
            print(key, {stage: round(s, 3) for stage, s in report[key].items()})
        for key, value in report["ratios"].items():
            print(f"{key:24} {value:8.3f}")
    return 0


def run(
    pairs: dict[str, tuple[SuiteDaemon, SuiteDaemon]],
    root: Path,
    master: LocalMaster,
    n_blocks: int,
    block: int,
    repeat: int,
) -> dict[str, Any]:
    """`repeat` rounds on each pair of daemons (A publishes, B hits), the pairs in turn."""
    total = n_blocks * block
    remote: dict[str, list[float]] = {name: [] for name in pairs}
    stages: dict[str, list[dict[str, float]]] = {name: [] for name in pairs}
    local: list[float] = []
    tier_get: list[float] = []
    tier_get_fresh: list[float] = []
    tier_batch: list[float] = []
    tier_put: list[float] = []
    fresh: list[float] = []
    rng = np.random.default_rng(7)
    for round_ in range(repeat):
        for name, (a, b) in pairs.items():
            identity = Identity(
                model="bench", weights=f"w{round_}{name}", tokenizer="t", template="c",
                rope="r", kv_layout="bf16", block_tokens=BLOCK_TOKENS, tenant="bench",
            )  # fmt: skip
            got = _round(a, b, identity, n_blocks, block, round_, rng, stages[name])
            remote[name].append(got[0])
            if not name:
                local.append(got[1])
                keys = got[2]
        tier_get.append(_tier_get(master, keys, block))
        if not round_:
            tier_get_fresh.append(_tier_get(master, keys, block, fresh=True))
        tier_batch.append(_tier_batch_get(master, keys, block))
        tier_put.append(_tier_put(master, keys, block, round_))
        fresh.append(_fresh_write(root, n_blocks, block, rng))
    return {
        **{
            f"remote_hit{n}_gbps": total / statistics.median(s[1:] or s) / 1e9
            for n, s in remote.items()
        },
        "remote_hit_first_gbps": total / remote[""][0] / 1e9,
        "local_hit_gbps": total / statistics.median(local) / 1e9,
        "mooncake_get_gbps": total / statistics.median(tier_get) / 1e9,
        "mooncake_get_fresh_gbps": total / tier_get_fresh[0] / 1e9,
        "mooncake_batch_get_gbps": total / statistics.median(tier_batch) / 1e9,
        "mooncake_put_gbps": total / statistics.median(tier_put) / 1e9,
        "fresh_write_gbps": total / statistics.median(fresh) / 1e9,
        **{
            f"remote_hit{n}_stages_s": {
                stage: statistics.median(r[stage] for r in rounds[1:] or rounds)
                for stage in (*STAGES, SERVED)
            }
            for n, rounds in stages.items()
        },
        "remote_hit_first_stages_s": stages[""][0],
        "bytes": total,
        "seconds": {
            **{f"remote_hit{n}": s for n, s in remote.items()},
            "local_hit": local,
            "mooncake_get": tier_get,
            "mooncake_get_fresh": tier_get_fresh,
            "mooncake_batch_get": tier_batch,
            "mooncake_put": tier_put,
            "fresh_write": fresh,
        },
    }


def _round(
    a: SuiteDaemon,
    b: SuiteDaemon,
    identity: Identity,
    n_blocks: int,
    block: int,
    round_: int,
    rng: np.random.Generator,
    stages: list[dict[str, float]],
) -> tuple[float, float, list[str]]:
    """A stores and publishes a prompt; B's remote hit, then its local hit; the tier's keys.
    B's seconds in each stage of the remote hit go to `stages`."""
    total = n_blocks * block
    tokens = rng.integers(0, 1 << 31, n_blocks * BLOCK_TOKENS, dtype=np.uint32)
    payloads = [rng.integers(0, 256, block, dtype=np.uint8) for _ in range(n_blocks)]
    with Client(a.socket, region_bytes=total + (1 << 20)) as client:
        for start in range(0, n_blocks, 64):
            client.put(identity, tokens, payloads[start : start + 64], first_block=start)
        wait_published(client, n_blocks * (round_ + 1))
    with Client(b.socket, region_bytes=total + (1 << 20), timeout=600) as client:
        before = client.stats()["metrics"]["cluster"]
        started = time.perf_counter()
        [hit] = client.lookup(identity, [tokens])
        loaded = client.load(identity, tokens)
        remote = time.perf_counter() - started
        after = wait_installed(client, before.get("remote_installed_blocks", 0) + n_blocks)
        stages.append(
            {
                **{
                    stage: (
                        after.get(f"remote_{stage}_us", 0) - before.get(f"remote_{stage}_us", 0)
                    )
                    / 1e6
                    for stage in STAGES
                },
                # of the blocks, the share loads copied from the fetch buffers, installs behind
                SERVED: (
                    after.get("remote_staged_served_blocks", 0)
                    - before.get("remote_staged_served_blocks", 0)
                )
                / n_blocks,
            }
        )
        assert hit.n_blocks == loaded.n_blocks == n_blocks, (hit, loaded.n_blocks)
        assert all(bytes(v) == p.tobytes() for v, p in zip(loaded.views, payloads, strict=True))
        loaded.release()  # its region space is what the second load needs
        started = time.perf_counter()
        with client.load(identity, tokens) as again:
            local = time.perf_counter() - started
            assert again.n_blocks == n_blocks
        client.delete(identity, [tokens[:BLOCK_TOKENS]])  # the first block and all below it:
        # the next round installs into the pages this frees
    keys = [block_key(identity, h) for h in BlockChain(identity, tokens).hashes()]
    return remote, local, keys


def _tier_get(master: LocalMaster, keys: list[str], block: int, *, fresh: bool = False) -> float:
    """Mooncake's own get of the objects, one after another into one buffer; with `fresh`, each
    into a buffer of its own, kept to the end: no page written is one an earlier get wrote (a
    fresh mapping's pages, first touched by the get itself)."""
    room = block + (64 << 10)  # the value: header, record, payload
    with SharedTier(master.settings(segment_bytes=0, timeout_s=60)) as tier:
        one = bytearray(room)  # written once before the timing, like a reused buffer
        outs: list[Any] = (
            [np.empty(room, dtype=np.uint8) for _ in keys] if fresh else [one] * len(keys)
        )
        started = time.perf_counter()
        for key, out in zip(keys, outs, strict=True):
            assert tier.get_into(key, out) is not None
        return time.perf_counter() - started


def _tier_put(master: LocalMaster, keys: list[str], block: int, round_: int) -> float:
    """Mooncake's own put of the same values under other keys, one after another (the copies
    live in the putting client's segment, which lends room for them)."""
    size = len(keys) * (block + (64 << 10))
    with SharedTier(master.settings(segment_bytes=max(16 << 20, 2 * size), timeout_s=60)) as tier:
        values = []
        for key in keys:
            out = bytearray(block + (64 << 10))
            n = tier.get_into(key, out)
            assert n is not None
            values.append(memoryview(out)[:n])
        started = time.perf_counter()
        for i, value in enumerate(values):
            tier.put(f"bench-put-{round_}-{i}", value)
        return time.perf_counter() - started


def _tier_batch_get(master: LocalMaster, keys: list[str], block: int) -> float:
    """Mooncake's batch get of the objects, 32 a round trip."""
    with SharedTier(master.settings(segment_bytes=0, timeout_s=60)) as tier:
        capacity = block + (64 << 10)
        batch = bytearray(32 * capacity)
        started = time.perf_counter()
        for first in range(0, len(keys), 32):
            got = tier.get_many_into(keys[first : first + 32], batch, capacity)
            assert None not in got and min(n for n in got if n is not None) > 0
        return time.perf_counter() - started


def _fresh_write(root: Path, n_blocks: int, block: int, rng: np.random.Generator) -> float:
    """`n_blocks` blocks of bytes written into a new file in `root` (then removed), one write a
    block, no fsync: new page-cache pages, as a remote hit's install needs."""
    data = rng.integers(0, 256, block, dtype=np.uint8).tobytes()
    path = root / "fresh-write"
    with path.open("wb", buffering=0) as file:
        started = time.perf_counter()
        for _ in range(n_blocks):
            file.write(data)
        took = time.perf_counter() - started
    path.unlink()
    return took


def wait_installed(client: Client, n: int) -> dict[str, int]:
    """B's shared-tier counts once its bridge installed `n` remote blocks in all (a hit is
    served before its installs end: their time is counted when they do)."""
    deadline = time.monotonic() + 120
    while (counts := client.stats()["metrics"]["cluster"]).get("remote_installed_blocks", 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"node B did not install the blocks in time: {counts}")
        time.sleep(0.01)
    return dict(counts)


def wait_published(client: Client, n: int) -> None:
    deadline = time.monotonic() + 120
    while client.stats()["metrics"]["cluster"].get("published_blocks", 0) < n:
        if time.monotonic() > deadline:
            counts = client.stats()["metrics"]["cluster"]
            raise TimeoutError(f"node A did not publish its blocks in time: {counts}")
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
