"""prefixd as vLLM's secondary tier, against vLLM's own file tier, on the same bytes in one run.

Run in the vLLM venv (.ci/vllm-venv), from the repository root:

    VLLM_CPU_KVCACHE_SPACE=1 .venv-vllm/bin/python bench/vllm_tier.py [--json] [--part load|ttft]

* `load`: vLLM's real TieringOffloadingManager and CPU primary tier (tests/integrations/vllm/
  harness.py), `--rows` chunks of `--row-mib` each stored by one manager, then loaded by a fresh one
  (empty primary tier) the way vLLM's scheduler asks: lookups, promotions, loads into the primary
  tier's rows; the reader's first load (another request's) is not timed, as a running engine's
  tier has loaded before. GB/s from the first lookup to the last row in place (the scheduler's
  lookup reporting every chunk a hit; the rows are compared after the clock stops), for the prefixd
  tier and for vLLM's file tier ("fs", O_DIRECT where the filesystem has it, else buffered),
  each against memcpy of the same bytes between two touched buffers. Median of `--repeat` rounds.
* `ttft`: a real vLLM CPU engine on a small seeded model (27M parameters: 8 layers, hidden 512;
  tests/integrations/vllm/engine_run.py): process A stores `--prompts` distinct prompts' KV,
  process B (fresh, empty caches) generates them again; B's median time to first token (vLLM's
  own first-token latency) with the prompts served from prefixd, from vLLM's file tier, and
  recomputed (no offloading), and the tokens each got from its tier.
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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from suitelib import SuiteDaemon

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
    tier's first load: connections, mappings) untimed, then the second, timed. (seconds, equal)."""
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
    try:
        reader.rows().fill(0)  # a running engine's primary tier is in memory already
        (warm_keys, _), (keys, payloads) = requests
        reader.load(context("warm", warm_keys), warm_keys, poll_s=STEP_S)
        ctx = context("r", keys)
        started = time.perf_counter()
        hits = reader.settle(ctx, keys, poll_s=STEP_S)  # every row in the primary tier
        seconds = time.perf_counter() - started
        loaded = reader.read(ctx, keys[:hits])
    finally:
        reader.close()
    return seconds, loaded == payloads


def bench_load(root: Path, row_mib: int, rows: int, repeat: int) -> dict[str, Any]:
    row_bytes = row_mib * MiB
    n_bytes = row_bytes * rows
    daemon = SuiteDaemon(root, "prefixd", map_size=max(8 << 30, 6 * n_bytes * (repeat + 1)))
    daemon.start()
    results: dict[str, Any] = {"row_bytes": row_bytes, "rows": rows, "bytes": n_bytes}
    try:
        tiers = {
            "prefixd": lambda: prefixd_tier(str(daemon.socket), region_bytes=n_bytes + row_bytes),
            "fs": lambda: {"type": "fs", "root_dir": str(root / f"fs-{uuid.uuid4().hex[:6]}")},
        }
        times: dict[str, list[float]] = {name: [] for name in (*tiers, "memcpy")}
        equal = True
        for r in range(repeat + 1):  # round 0 warms up
            for name, tier in tiers.items():
                seconds, same = load_round(tier(), row_bytes, rows, seed=1000 * r + len(name))
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
    results["prefixd_vs_memcpy"] = round(results["memcpy_s"] / results["prefixd_s"], 3)
    results["fs_vs_memcpy"] = round(results["memcpy_s"] / results["fs_s"], 3)
    results["prefixd_vs_fs"] = round(results["fs_s"] / results["prefixd_s"], 3)
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
                ("prefixd", "prefixd-b.json"),
                ("fs", "fs-b.json"),
                ("plain", "recompute.json"),
            )
        }
        results["same_tokens_as_recompute"] = {
            name: outputs[name] == outputs["plain"] for name in ("prefixd", "fs")
        }
    finally:
        daemon.stop()
    for name in ("prefixd", "fs"):
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
    with tempfile.TemporaryDirectory(prefix="vllm-tier-") as tmp:
        if args.part in ("load", "all"):
            report["load"] = bench_load(Path(tmp) / "load", args.row_mib, args.rows, args.repeat)
        if args.part in ("ttft", "all"):
            report["ttft"] = bench_ttft(Path(tmp) / "ttft", args.prompt_tokens, args.prompts)
    print(json.dumps(report, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
