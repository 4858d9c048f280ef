"""Run ONE real vLLM CPU engine with LMCache's LMCacheMPConnector against a node server and write
what it did as JSON.

    python -m tests.integrations.lmcache.engine_run --model DIR --port PORT --prompt-json JSON \
        --out RESULT.json [--max-tokens N] [--no-offload]

Runs only in the vLLM venv (with lmcache added) and the worktree on PYTHONPATH. The engine core
runs in a process of its own (vLLM's default layout: in this process, the connector's import of
LMCache loads llvmlite before vLLM's CPU worker rebinds its triton kernels, and that scan of
sys.modules fails on an llvmlite wrapper), and stock vLLM and LMCache do the rest:
the connector's scheduler and worker halves talk to the node server at tcp://127.0.0.1:PORT
(`lmcache server --supported-transfer-mode auto`, with prefixd as its L2 adapter). The result
holds, per prompt, `num_cached_tokens` and `output_token_ids` (greedy, `ignore_eos`).
`--prompt-json` is as tests/integrations/vllm/engine_run.py takes it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.integrations.vllm.engine_run import _json_arg, make_prompts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-json", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--port", type=int, help="the node server's port")
    p.add_argument("--no-offload", action="store_true", help="no KV transfer config at all")
    p.add_argument("--max-tokens", type=int, default=12)
    args = p.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = make_prompts(_json_arg(args.prompt_json), vocab)
    engine: dict[str, Any] = {
        "model": args.model,
        "dtype": "float32",
        "block_size": 32,
        "enforce_eager": True,
        "skip_tokenizer_init": True,
        "seed": 0,
    }
    if not args.no_offload:
        engine["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheMPConnector",
            kv_role="kv_both",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": args.port,
            },
        )
    llm = LLM(**engine)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    results = []
    for ids in prompts:
        (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling, use_tqdm=False)
        results.append(
            {
                "num_prompt_tokens": len(ids),
                "num_cached_tokens": out.num_cached_tokens,
                "output_token_ids": list(out.outputs[0].token_ids),
            }
        )
        print(f"prompt: {len(ids)} tokens, cached {out.num_cached_tokens}", file=sys.stderr)
    llm.llm_engine.engine_core.shutdown()
    Path(args.out).write_text(json.dumps({"prompts": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
