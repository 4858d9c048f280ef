"""Keep a model's prefix cache across a daemon restart and a fresh engine process.

    python examples/transformers_restart.py [--family qwen3_next|kimi_linear|deepseek_v4|llama]

1. start a prefixd daemon on a temporary data directory and socket;
2. build a tiny model (random weights, seeded: every process builds the same one), prefill a
   prompt, and store its cache: `state_spec` names the state groups in the identity,
   `export_state` turns the cache into payloads, `Client.put_state` stores them;
3. restart the daemon (SIGTERM, start again): the cache is on disk now;
4. in a fresh process (this script again, with --restore), `Client.load_state` finds and loads
   the stored state, `restore_state` rebuilds a cache from it, and the model continues the prompt
   from there (explicit position_ids). The logits must match a full prefill of the whole prompt.

Exit status 0 when the largest logit difference is <= 1e-5, 1 otherwise. Needs no GPU and no
downloads. A hybrid model (the default) stores paged groups (attention keys/values) and
checkpoints (linear-attention states), so it shows both kinds of state.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, logging

from prefixd import Identity
from prefixd.client import Client, DaemonUnavailableError
from prefixd.integrations.transformers import export_state, restore_state, state_spec

VOCAB, BLOCK = 128, 8  # block_tokens: a multiple of DeepSeek-V4's compression rates (4, 8)
PREFIX, CONTINUE = 80, 16  # store 80 tokens (10 blocks); the prompt goes on for 16 more
TOLERANCE = 1e-5
# fmt: off
SMALL = {"vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4,
         "initializer_range": 0.1, "max_position_embeddings": 256}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}
HYBRID = ["linear_attention", "full_attention", "linear_attention"]
CONFIGS = {  # tiny configs of a few model families: building them downloads nothing
    "llama": lambda: AutoConfig.for_model(
        "llama", num_hidden_layers=2, intermediate_size=64, num_key_value_heads=2, **SMALL
    ),
    "qwen3_next": lambda: AutoConfig.for_model(  # Gated DeltaNet + full attention
        "qwen3_next", num_hidden_layers=3, layer_types=HYBRID, head_dim=8, intermediate_size=64,
        num_key_value_heads=2, linear_conv_kernel_dim=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        num_experts=4, shared_expert_intermediate_size=16, **MOE, **SMALL,
    ),
    "kimi_linear": lambda: AutoConfig.for_model(  # KDA linear attention + MLA
        "kimi_linear", num_hidden_layers=3, layer_types=HYBRID, q_lora_rank=None,
        intermediate_size=64, num_key_value_heads=4, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=8, linear_num_heads=4,
        linear_conv_kernel_dim=4, num_local_experts=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, **MOE, **SMALL,
    ),
    "deepseek_v4": lambda: AutoConfig.for_model(  # sliding window + compressed attention
        "deepseek_v4", num_hidden_layers=3, layer_types=["sliding_attention",
        "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], sliding_window=12, head_dim=16,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        partial_rotary_factor=0.5, q_lora_rank=16, o_groups=2, o_lora_rank=8, index_n_heads=2,
        index_head_dim=8, index_topk=256, n_routed_experts=4, hc_mult=2, **MOE, **SMALL,
    ),
}
# fmt: on


def build(family: str):
    torch.manual_seed(0)  # the same weights in every process
    config = CONFIGS[family]()
    return config, AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def identity(family: str, config) -> Identity:
    """What makes stored state reusable: model, weights, tokenizer, ... and the state layout."""
    return Identity(
        model=family,
        weights="seed-0",
        tokenizer="vocab-128",
        template="none",
        rope="default",
        kv_layout="float32",
        block_tokens=BLOCK,
        tenant="example",
        state=state_spec(config, block_tokens=BLOCK),
    )


def prompt() -> torch.Tensor:
    return torch.randint(
        0, VOCAB, (1, PREFIX + CONTINUE), generator=torch.Generator().manual_seed(1)
    )


def forward(model, ids: torch.Tensor, start: int, cache) -> torch.Tensor:
    """Logits of `ids` at positions start.. on top of `cache` (which grows)."""
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits


def store(socket: Path, family: str) -> None:
    config, model = build(family)
    ids = prompt()
    cache = DynamicCache(config=config)
    forward(model, ids[:, :PREFIX], 0, cache)  # the prefill an engine would run anyway
    payloads = export_state(config, cache, n_tokens=PREFIX, block_tokens=BLOCK)
    with Client(socket, region_bytes=16 << 20) as client:
        tokens = ids[0, :PREFIX].numpy().astype(np.uint32)
        stored = client.put_state(
            identity(family, config),
            tokens,
            paged=payloads.paged,
            checkpoints=payloads.checkpoints,
            upto_tokens=PREFIX,
        )
    print(
        f"stored {stored.stored} blocks of {family}: paged groups {sorted(payloads.paged)}, "
        f"checkpoints {sorted(payloads.checkpoints)}"
    )


def restore(socket: Path, family: str) -> int:
    """Runs in a fresh process: nothing of the storing process is left but the daemon's disk."""
    config, model = build(family)
    ids = prompt()
    with Client(socket, region_bytes=16 << 20) as client:
        hit = client.load_state(identity(family, config), ids[0].numpy().astype(np.uint32))
        parts = hit.by_group()  # each group's payloads, verified, in the client's region
        cache = restore_state(
            config,
            reusable_tokens=hit.reusable_tokens,
            block_tokens=BLOCK,
            paged={g: [p.view for p in ps] for g, ps in parts.items() if ps[0].tokens},
            checkpoints={g: ps[0].view for g, ps in parts.items() if not ps[0].tokens},
        )
    start = hit.reusable_tokens  # skip what was restored; compute only the rest
    logits = forward(model, ids[:, start:], start, cache)
    reference = forward(model, ids, 0, DynamicCache(config=config))[:, start:]
    diff = (logits - reference).abs().max().item()
    print(f"reusable tokens: {start} of {ids.shape[1]} (stored: {PREFIX})")
    print(f"max abs logit difference vs a full prefill: {diff:.3e} (tolerance {TOLERANCE:g})")
    return 0 if start == PREFIX and diff <= TOLERANCE else 1


def start_daemon(data_dir: Path, socket: Path) -> subprocess.Popen:
    """`prefixd serve` (run as `python -m prefixd` so it is this environment's), once it answers."""
    env = {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}
    command = [sys.executable, "-m", "prefixd", "serve", "--map-size", "256MiB"]
    command += ["--data-dir", str(data_dir), "--socket", str(socket), "--log-level", "warning"]
    daemon = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and daemon.poll() is None:
        try:
            with Client(socket) as client:
                client.health()
            return daemon
        except DaemonUnavailableError:
            time.sleep(0.1)
    stop_daemon(daemon)
    raise RuntimeError(f"the daemon did not start (exit code {daemon.returncode})")


def stop_daemon(daemon: subprocess.Popen) -> None:
    if daemon.poll() is None:
        daemon.send_signal(signal.SIGTERM)  # a clean shutdown: everything stored is on disk
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description="prefixd: restore a transformers cache")
    parser.add_argument("--family", choices=sorted(CONFIGS), default="qwen3_next")
    parser.add_argument("--restore", type=Path, metavar="SOCKET", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.set_verbosity_error()  # hide notes about optional fast kernels
    if args.restore:
        return restore(args.restore, args.family)
    workdir = Path(tempfile.mkdtemp(prefix="prefixd-example-"))
    data_dir, socket = workdir / "data", workdir / "prefixd.sock"
    daemon = None
    try:
        daemon = start_daemon(data_dir, socket)
        store(socket, args.family)
        stop_daemon(daemon)
        print(f"daemon stopped (exit code {daemon.returncode}); starting it again")
        daemon = start_daemon(data_dir, socket)
        fresh = [sys.executable, __file__, "--restore", str(socket), "--family", args.family]
        return subprocess.run(fresh, check=False).returncode
    finally:  # stop the daemon whatever happened
        if daemon is not None:
            stop_daemon(daemon)
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
