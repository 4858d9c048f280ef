"""prefixd behind vLLM both ways (the direct spec, the tier behind vLLM's CPU tier), against vLLM's
own file tier and against recomputing, on the same bytes and prompts in one run.

Run in the vLLM venv (.ci/vllm-venv), from the repository root:

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_bench.py [--json] [--part load|ttft]

* `load`: `--rows` chunks of `--row-mib` each stored by one engine's offloading, then loaded by a
  fresh one the way vLLM's scheduler asks, into its KV cache (CPU tensors here): for the direct
  spec, its manager and worker (tests/integrations/vllm/direct.py: lookups until every chunk is a
  hit, held verified in the region, then the worker's load into the KV cache's blocks); for the
  tiers, vLLM's real TieringOffloadingManager and CPU primary tier (tests/integrations/vllm/
  harness.py: lookups, promotions into the primary tier's rows), then the copy of those rows into
  the KV cache that vLLM's worker makes (here one memcpy per block, as the direct spec's worker
  copies on the CPU). The prefixd tier
  and vLLM's file tier ("fs", O_DIRECT where the filesystem has it, else buffered) are measured so.
  The reader's first load (another request's) is not timed, as a running engine has loaded before.
  GB/s from the first lookup to the last byte in the KV cache (compared after the clock stops),
  each against memcpy of the same bytes between two touched buffers; the ratio of the direct spec
  to the tier round by round. Median of `--repeat` rounds, the ways in turns.
* `ttft`: a real vLLM CPU engine on a small seeded model (27M parameters: 8 layers, hidden 512;
  tests/integrations/vllm/engine_run.py): process A stores `--prompts` distinct prompts' KV,
  process B (fresh, empty caches) generates them again; B's median time to first token (vLLM's
  own first-token latency) with the prompts served by the direct spec, the prefixd tier, vLLM's
  file tier, and recomputed (no offloading), and the tokens each got from its tier.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from suitelib import SuiteDaemon

from tests.integrations.vllm.direct import PER, Direct
from tests.integrations.vllm.harness import Engine, context, prefixd_tier, request_keys

MiB = 1 << 20
STEP_S = 0.001  # how often the scheduler steps while a load is under way (a short forward pass)


def memcpy_s(n_bytes: int) -> float:
    """One copy of `n_bytes` between two buffers already touched (no first-touch page faults:
    the tiers copy into a primary tier and a region that are touched before they load)."""
    src = np.ones(n_bytes, dtype=np.uint8)
    dst = np.ones(n_bytes, dtype=np.uint8)
    started = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - started


def load_round(tier: dict[str, Any], row_bytes: int, rows: int, seed: int) -> tuple[float, bool]:
    """Store two requests of `rows` rows through one manager; a fresh one loads the first (its
    tier's first load: connections, mappings) untimed, then the second, timed, into a KV cache
    (one tensor of `rows` blocks of `row_bytes`). (seconds, equal)."""
    rng = np.random.default_rng(seed)
    requests = []
    for n in range(2):
        keys = request_keys(seed * 2 + n, rows)
        payloads = [rng.integers(0, 256, row_bytes, dtype=np.uint8).tobytes() for _ in range(rows)]
        requests.append((keys, payloads))
    writer = Engine.with_tier(tier, row_bytes, rows)
    try:
        for n, (keys, payloads) in enumerate(requests):
            writer.store(context(f"w{n}", keys), keys, payloads)
    finally:
        writer.close()
    reader = Engine.with_tier(tier, row_bytes, 2 * rows)
    kv = torch.zeros((rows, row_bytes), dtype=torch.uint8)  # touched, as an engine's is
    try:
        reader.rows().fill(0)  # a running engine's primary tier is in memory already
        (warm_keys, _), (keys, payloads) = requests
        reader.load(context("warm", warm_keys), warm_keys, poll_s=STEP_S)
        ctx = context("r", keys)
        started = time.perf_counter()
        hits = reader.settle(ctx, keys, poll_s=STEP_S)  # every row in the primary tier
        spec = reader.manager.prepare_load(keys[:hits], ctx)
        rows_in_tier, into = reader.rows(), kv.numpy()
        for block, chunk in enumerate(spec.block_ids.tolist()):  # the worker's copy, a memcpy each
            np.copyto(into[block], rows_in_tier[chunk])
        seconds = time.perf_counter() - started
        del rows_in_tier  # vLLM unmaps the primary tier on close: no view of it may be left
        loaded = [kv[i].numpy().tobytes() for i in range(hits)]
    finally:
        reader.close()
    return seconds, loaded == payloads


def direct_round(socket: str, row_bytes: int, rows: int, seed: int) -> tuple[float, bool]:
    """The same through the direct spec: one engine stores two requests from its KV cache, a fresh
    one loads the first untimed, then the second, timed, into its KV cache. (seconds, equal)"""
    pages = (row_bytes // PER // 2,) * 2  # two layers: a chunk of PER blocks is `row_bytes`
    region = rows * row_bytes + (1 << 20)  # a request's chunks at once, for hits and for stores
    settings = {"region_bytes": region, "store_region_bytes": region}
    writer = Direct.start(socket, pages=pages, blocks=2 * rows * PER, **settings)
    requests = []
    try:
        for n in range(2):
            keys = request_keys(seed * 2 + n, rows)
            blocks = list(range(n * rows * PER, (n + 1) * rows * PER))
            data = writer.fill(blocks, seed * 2 + n)
            assert writer.store(context(f"w{n}", keys), keys, blocks) == keys
            requests.append((keys, data))
    finally:
        writer.close()
    reader = Direct.start(socket, pages=pages, blocks=rows * PER, **settings)
    try:
        for layer in reader.kv:
            layer.fill_(1)  # touched, as an engine's is
        into = list(range(rows * PER))
        (warm_keys, _), (keys, data) = requests
        warm = context("warm", warm_keys)
        warm_hits = reader.settle(warm, warm_keys, poll_s=STEP_S)
        reader.load(warm, warm_keys[:warm_hits], into[: warm_hits * PER])
        ctx = context("r", keys)
        started = time.perf_counter()
        hits = reader.settle(ctx, keys, poll_s=STEP_S)  # every chunk held verified in the region
        reader.load(ctx, keys[:hits], into[: hits * PER])
        seconds = time.perf_counter() - started
        loaded = reader.blocks(into[: hits * PER])
    finally:
        reader.close()
    return seconds, hits == rows and loaded == data


def bench_load(root: Path, row_mib: int, rows: int, repeat: int) -> dict[str, Any]:
    row_bytes = row_mib * MiB
    n_bytes = row_bytes * rows
    daemon = SuiteDaemon(root, "prefixd", map_size=max(8 << 30, 9 * n_bytes * (repeat + 1)))
    daemon.start()
    results: dict[str, Any] = {"row_bytes": row_bytes, "rows": rows, "bytes": n_bytes}
    try:
        ways = {
            "direct": lambda seed: direct_round(str(daemon.socket), row_bytes, rows, seed),
            "prefixd": lambda seed: load_round(
                prefixd_tier(str(daemon.socket), region_bytes=n_bytes + row_bytes),
                row_bytes,
                rows,
                seed,
            ),
            "fs": lambda seed: load_round(
                {"type": "fs", "root_dir": str(root / f"fs-{uuid.uuid4().hex[:6]}")},
                row_bytes,
                rows,
                seed,
            ),
        }
        times: dict[str, list[float]] = {name: [] for name in (*ways, "memcpy")}
        equal = True
        for r in range(repeat + 1):  # round 0 warms up
            names = list(ways)
            names = names[r % len(names) :] + names[: r % len(names)]  # each round in turn
            for name in names:
                seconds, same = ways[name](1000 * r + len(name))
                equal &= same
                if r:
                    times[name].append(seconds)
            if r:
                times["memcpy"].append(memcpy_s(n_bytes))
    finally:
        daemon.stop()
    for name, samples in times.items():
        median = statistics.median(samples)
        results[f"{name}_s"] = round(median, 6)
        results[f"{name}_gbps"] = round(n_bytes / median / 1e9, 3)
    for name in ("direct", "prefixd", "fs"):
        results[f"{name}_vs_memcpy"] = round(results["memcpy_s"] / results[f"{name}_s"], 3)
    results["prefixd_vs_fs"] = round(results["fs_s"] / results["prefixd_s"], 3)
    ratios = [t / d for t, d in zip(times["prefixd"], times["direct"], strict=True)]
    results["direct_vs_tier"] = {
        "median": round(statistics.median(ratios), 3),
        "spread": [round(min(ratios), 3), round(max(ratios), 3)],
        "target": 1.3,
    }
    results["bytes_equal"] = equal
    return results


# A model big enough that prefill costs more than loading its KV (the tiny test model is not).
MODEL = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
}


def engine_run(model: Path, out: Path, prompt: Path, *extra: str) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "tests.integrations.vllm.engine_run", "--model", str(model),
        "--prompt-json", str(prompt), "--out", str(out), "--max-tokens", "1",
        "--max-model-len", "2048", "--cpu-bytes", str(256 * MiB), *extra,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(command, check=True, cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def bench_ttft(root: Path, prompt_tokens: int, prompts: int) -> dict[str, Any]:
    from tests.integrations.vllm.tiny_model import build_tiny_model

    model = build_tiny_model(root / "model", **MODEL)
    prompt = root / "prompt.json"
    prompt.write_text(json.dumps({"random": [prompt_tokens] * prompts, "seed": 7}))
    daemon = SuiteDaemon(root, "prefixd-ttft")
    daemon.start()
    results: dict[str, Any] = {"prompt_tokens": prompt_tokens, "prompts": prompts}

    def median_ttft(run: dict[str, Any]) -> float:
        return round(statistics.median(p["ttft_s"] for p in run["prompts"]), 6)

    try:
        runs = {
            "direct": ["--prefixd-socket", str(daemon.socket), "--prefixd-direct"],
            "prefixd": ["--prefixd-socket", str(daemon.socket)],
            "fs": ["--tier-json", json.dumps([{"type": "fs", "root_dir": str(root / "fs-ttft")}])],
        }
        for name, flags in runs.items():
            engine_run(model, root / f"{name}-a.json", prompt, *flags)  # stores the prompt
            b = engine_run(model, root / f"{name}-b.json", prompt, *flags)
            results[f"{name}_ttft_s"] = median_ttft(b)
            results[f"{name}_cached_tokens"] = [p["num_cached_tokens"] for p in b["prompts"]]
        plain = engine_run(model, root / "recompute.json", prompt, "--no-offload")
        results["recompute_ttft_s"] = median_ttft(plain)
        outputs = {
            name: [p["output_token_ids"] for p in json.loads((root / f).read_text())["prompts"]]
            for name, f in (
                ("direct", "direct-b.json"),
                ("prefixd", "prefixd-b.json"),
                ("fs", "fs-b.json"),
                ("plain", "recompute.json"),
            )
        }
        results["same_tokens_as_recompute"] = {
            name: outputs[name] == outputs["plain"] for name in ("direct", "prefixd", "fs")
        }
    finally:
        daemon.stop()
    for name in ("direct", "prefixd", "fs"):
        results[f"{name}_vs_recompute"] = round(
            results["recompute_ttft_s"] / results[f"{name}_ttft_s"], 3
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("load", "ttft", "all"), default="all")
    parser.add_argument("--row-mib", type=int, default=2, help="bytes of one chunk (MiB)")
    parser.add_argument("--rows", type=int, default=128, help="chunks loaded per round")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--prompt-tokens", type=int, default=1800)
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report: dict[str, Any] = {
        "machine": f"{platform.node()} {os.cpu_count()} cpus, {platform.python_version()}",
        "command": " ".join(sys.argv),
    }
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        if args.part in ("load", "all"):
            report["load"] = bench_load(Path(tmp) / "load", args.row_mib, args.rows, args.repeat)
        if args.part in ("ttft", "all"):
            report["ttft"] = bench_ttft(Path(tmp) / "ttft", args.prompt_tokens, args.prompts)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
