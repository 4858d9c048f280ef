"""Run ONE real vLLM CPU engine over token-id prompts and write what it did as JSON.

    python -m tests.integrations.vllm.engine_run --model DIR --tier-json JSON \
        --prompt-json FILE_OR_JSON --out RESULT.json [--max-tokens N] [--block-size 32] ...

Runs only in the vLLM venv, with the worktree on PYTHONPATH. The engine runs the stock
OffloadingConnector with `CPUTieringOffloadingSpec` (tests/integrations/vllm/cpu_spec.py: vLLM's
TieringOffloadingSpec with a synchronous CPU copy in its worker) and the secondary tiers given by
`--tier-json` (a list of tier configs, as `secondary_tiers`), or with no KV transfer at all
(`--no-offload`, the uncached baseline).

`--prompt-json` is a JSON list of token-id lists, inline or in a file, or
`{"random": [LENGTH, ...], "seed": S}` for seeded random ids in [3, vocab). Each prompt is generated
on its own (greedy, `ignore_eos`, `--max-tokens`), one after another, so its time to first token is
its own. The result holds, per prompt, `num_cached_tokens` (from the RequestOutput: tokens not
computed by this request, whether from vLLM's own prefix cache or from the connector),
`output_token_ids`, `ttft_s` (vLLM's first-token latency: arrival to first token) and `wall_s`
(the generate call), plus `engine_start_s`, `drain_s` and the connector's layout (`connector`).

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0; `--multiprocess` gives
vLLM's default layout instead), so the script can step it after the last prompt until the connector
has no pending work (the last chunks' stores are submitted on the step after they are prepared, and
the tiers' writes finish on their own threads: an engine shut down before that drops them), then
shuts it down: the worker's copy, the tiering manager and every secondary tier's `shutdown()`
(recorded in `tiers_shut_down`). Exit status 0 means all of that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

SPEC_NAME = "CPUTieringOffloadingSpec"
SPEC_MODULE = "tests.integrations.vllm.cpu_spec"
DRAIN_TIMEOUT_S = 120.0


def _json_arg(text: str) -> Any:
    """Inline JSON, or the path of a file holding it."""
    stripped = text.lstrip()
    if stripped[:1] in ("[", "{"):
        return json.loads(text)
    return json.loads(Path(text).read_text())


def make_prompts(spec: Any, vocab: int) -> list[list[int]]:
    """Prompts from `--prompt-json`: token-id lists, or {"random": [length, ...], "seed": s}."""
    if isinstance(spec, dict):
        import numpy as np

        rng = np.random.default_rng(int(spec.get("seed", 0)))
        return [rng.integers(3, vocab, size=int(n)).tolist() for n in spec["random"]]
    if not (isinstance(spec, list) and all(isinstance(p, list) for p in spec)):
        raise SystemExit("--prompt-json: a list of token-id lists, or {'random': [...], 'seed': s}")
    return [[int(t) for t in p] for p in spec]


def connector_config(args: argparse.Namespace) -> dict[str, Any]:
    """kv_connector_extra_config for the OffloadingConnector with the test spec."""
    extra: dict[str, Any] = {
        "spec_name": SPEC_NAME,
        "spec_module_path": SPEC_MODULE,
        "cpu_bytes_to_use": args.cpu_bytes,
        "secondary_tiers": _json_arg(args.tier_json) if args.tier_json else [],
    }
    if args.extra_config:
        extra.update(_json_arg(args.extra_config))
    return extra


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (see tiny_model.py)")
    p.add_argument(
        "--hub-cache",
        help="a Hugging Face cache (hub_cache.py): --model is then a repo id served from it, "
        "offline, as an engine names a model it downloaded",
    )
    p.add_argument("--prompt-json", required=True, help="token-id prompts: JSON or a JSON file")
    p.add_argument("--out", required=True, help="where to write the result JSON")
    p.add_argument("--tier-json", help="secondary_tiers: a JSON list of tier configs, or a file")
    p.add_argument("--no-offload", action="store_true", help="no KV transfer config at all")
    p.add_argument(
        "--prefixd-socket",
        help="prefixd as the secondary tier, at this daemon socket: the transfer config comes "
        "from prefixd.integrations.vllm.kv_transfer_config (the identity from the engine's config)",
    )
    p.add_argument("--prefixd-tenant", default="default")
    p.add_argument(
        "--prefixd-direct",
        action="store_true",
        help="with --prefixd-socket: prefixd as the whole offloading spec (PrefixdOffloadingSpec), "
        "not a secondary tier behind vLLM's CPU tier",
    )
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--block-size", type=int, default=32, help="KV block size (multiple of 32)")
    p.add_argument(
        "--cpu-bytes",
        type=int,
        default=8 << 20,
        help="cpu_bytes_to_use: the primary CPU tier's size (default 8 MiB)",
    )
    p.add_argument("--extra-config", help="more kv_connector_extra_config keys (JSON or file)")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--seed", type=int, default=0, help="engine seed")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="turn off vLLM's own prefix cache (hits then come only from the connector)",
    )
    p.add_argument(
        "--engine-args", help="more keyword arguments for vllm.LLM (JSON object or file)"
    )
    p.add_argument(
        "--multiprocess",
        action="store_true",
        help="vLLM's default process layout (engine core and worker in processes of their own); "
        "the tiers then cannot be watched from here: no 'connector', 'tiers_shut_down' is null",
    )
    return p.parse_args(argv)


def _model_dir(args: argparse.Namespace) -> Path:
    """Where the model's files are: its directory, or the snapshot its repo's `main` names."""
    if args.hub_cache is None:
        return Path(args.model)
    repo = Path(args.hub_cache) / f"models--{args.model.replace('/', '--')}"
    return repo / "snapshots" / (repo / "refs" / "main").read_text().strip()


def _scheduler(llm: Any) -> Any:
    # LLM -> LLMEngine -> InprocClient -> EngineCore -> Scheduler (in-process engine core only)
    return llm.llm_engine.engine_core.engine_core.scheduler


def _drain(llm: Any, multiprocess: bool) -> int:
    """Step the engine until nothing (connector stores, tier writes) is pending; return the polls.

    In-process, this loop steps the engine; a separate engine core steps itself while it has work,
    so then the loop only asks it."""
    client = llm.llm_engine.engine_core
    pending = (
        (lambda: client.call_utility("has_work")) if multiprocess else _scheduler(llm).has_requests
    )
    polls = 0
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while pending():
        if time.monotonic() > deadline:
            raise RuntimeError(f"connector still has pending work after {DRAIN_TIMEOUT_S} s")
        if not multiprocess:
            llm.llm_engine.step()
        polls += 1
        time.sleep(0.002)  # the tiers' I/O threads need the cores more than this loop does
    return polls


def _describe_connector(llm: Any) -> tuple[dict[str, Any], list[Any]]:
    """The connector's chunking and the primary tier's layout, and the secondary tiers."""
    connector = _scheduler(llm).connector
    if connector is None:
        return {}, []
    scheduler = connector.connector_scheduler
    manager = scheduler.manager
    if not hasattr(manager, "primary_tier"):  # prefixd's own spec: no tiers
        return {"manager": type(manager).__name__}, []
    view = manager.primary_tier.get_kv_memoryview()
    info: dict[str, Any] = {
        "manager": type(manager).__name__,
        "blocks_per_chunk": scheduler.config.blocks_per_chunk,
        "tokens_per_hash": scheduler.config.tokens_per_hash,
        "groups": [
            {"group_idx": g.group_idx, "tokens_per_chunk": g.tokens_per_chunk}
            for g in scheduler.config.kv_group_configs
        ],
        "primary_kv_view": {
            "shape": list(view.shape or ()),
            "strides": list(view.strides or ()),
            "format": view.format,
            "nbytes": view.nbytes,
        },
        "tiers": [type(t).__name__ for t in manager.secondary_tiers],
    }
    return info, list(manager.secondary_tiers)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.hub_cache is None:
        return run(args)
    from .hub_cache import serving

    with serving(Path(args.hub_cache)):
        return run(args)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if args.multiprocess else "0"

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    vocab = json.loads((_model_dir(args) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(_json_arg(args.prompt_json), vocab)

    engine_kwargs: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "disable_log_stats": False,  # RequestOutput.metrics (the first-token latency)
        "seed": args.seed,
        "enable_prefix_caching": not args.no_prefix_caching,
    }
    if args.max_model_len is not None:
        engine_kwargs["max_model_len"] = args.max_model_len
    if args.engine_args:
        engine_kwargs.update(_json_arg(args.engine_args))
    extra: dict[str, Any] | None = None
    if args.prefixd_socket:
        from vllm.engine.arg_utils import EngineArgs

        from prefixd.integrations.vllm import kv_transfer_config

        if args.prefixd_direct:
            config = kv_transfer_config(
                EngineArgs(**engine_kwargs),
                socket=args.prefixd_socket,
                tenant=args.prefixd_tenant,
                direct=True,
            )
        else:
            config = kv_transfer_config(
                EngineArgs(**engine_kwargs),
                socket=args.prefixd_socket,
                tenant=args.prefixd_tenant,
                spec_name=SPEC_NAME,
                spec_module_path=SPEC_MODULE,
                extra_config={"cpu_bytes_to_use": args.cpu_bytes},
            )
        extra = config.kv_connector_extra_config
        engine_kwargs["kv_transfer_config"] = config
    elif not args.no_offload:
        extra = connector_config(args)
        engine_kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both", kv_connector_extra_config=extra
        )

    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs)
    engine_start_s = time.perf_counter() - t0
    connector, tiers = ({}, []) if args.multiprocess else _describe_connector(llm)
    shut_down: list[str] = []
    for tier in tiers:
        original = tier.shutdown

        def recording_shutdown(original: Any = original, name: str = tier.tier_type) -> None:
            original()
            shut_down.append(name)

        tier.shutdown = recording_shutdown

    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for ids in prompts:
        t = time.perf_counter()
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)
        wall_s = time.perf_counter() - t
        metrics = out.metrics
        results.append(
            {
                "num_prompt_tokens": len(ids),
                "num_cached_tokens": out.num_cached_tokens,
                "output_token_ids": list(out.outputs[0].token_ids),
                "ttft_s": getattr(metrics, "first_token_latency", None),
                "wall_s": wall_s,
            }
        )
        print(
            f"prompt {len(results)}: {len(ids)} tokens, cached {out.num_cached_tokens}, "
            f"ttft {results[-1]['ttft_s']}, wall {wall_s:.3f} s",
            file=sys.stderr,
        )

    t = time.perf_counter()
    drain_steps = _drain(llm, args.multiprocess)
    drain_s = time.perf_counter() - t
    t = time.perf_counter()
    llm.llm_engine.engine_core.shutdown()
    shutdown_s = time.perf_counter() - t
    if not args.multiprocess and len(shut_down) != len(tiers):
        raise RuntimeError(f"tiers shut down: {shut_down} of {[t.tier_type for t in tiers]}")

    result = {
        "mode": "no-offload" if args.no_offload else "offload",
        "multiprocess": args.multiprocess,
        "model": args.model,
        "engine_start_s": engine_start_s,
        "drain_steps": drain_steps,
        "drain_s": drain_s,
        "shutdown_s": shutdown_s,
        "tiers_shut_down": None if args.multiprocess else shut_down,
        "kv_connector_extra_config": extra,
        "connector": connector,
        "prompts": results,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
