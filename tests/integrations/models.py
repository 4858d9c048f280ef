"""A zoo of tiny `transformers` models, one per family prefixd maps to state groups.

Each is built from its config with seeded random weights (float32, CPU, no downloads), so every
process that builds a family gets the same model: a test can store state in one process and
restore it in another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

TOL = 1e-5
VOCAB = 128
BLOCK = 8  # block_tokens: a multiple of the V4 compression rates (4 and 8)
PAGE = 2  # page_blocks
PREFIX = 80  # 10 blocks, 5 pages
CONTINUE = 16
WINDOW = 12  # sliding window: the prefixes are well past it
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
}
MLA = {
    **COMMON,
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 16}

CONFIGS: dict[str, Callable[[], object]] = {
    "llama": lambda: AutoConfig.for_model("llama", num_hidden_layers=2, **COMMON),
    "mistral": lambda: AutoConfig.for_model(
        "mistral", num_hidden_layers=2, sliding_window=WINDOW, **COMMON
    ),
    "gemma3_text": lambda: AutoConfig.for_model(
        "gemma3_text",
        num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=WINDOW,
        head_dim=8,
        query_pre_attn_scalar=8,
        **COMMON,
    ),
    "qwen3_next": lambda: AutoConfig.for_model(
        "qwen3_next",
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        head_dim=8,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        shared_expert_intermediate_size=16,
        **MOE,
        **COMMON,
    ),
    "kimi_linear": lambda: AutoConfig.for_model(
        "kimi_linear",
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        q_lora_rank=None,
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        num_local_experts=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        **MOE,
        **MLA,
    ),
    "deepseek_v3": lambda: AutoConfig.for_model(
        "deepseek_v3",
        num_hidden_layers=2,
        q_lora_rank=24,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        **MOE,
        **MLA,
    ),
    "deepseek_v4": lambda: AutoConfig.for_model(
        "deepseek_v4",
        num_hidden_layers=3,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=WINDOW,
        vocab_size=VOCAB,
        hidden_size=32,
        num_attention_heads=4,
        head_dim=16,
        partial_rotary_factor=0.5,
        q_lora_rank=16,
        o_groups=2,
        o_lora_rank=8,
        index_n_heads=2,
        index_head_dim=8,
        index_topk=256,  # >= every sequence here: top-k ties cannot make the reference inexact
        n_routed_experts=4,
        hc_mult=2,
        max_position_embeddings=256,
        initializer_range=0.1,
        **MOE,
    ),
}
FAMILIES = list(CONFIGS)


@functools.cache
def build(family: str, dtype: torch.dtype = torch.float32):
    torch.manual_seed(0)
    config = CONFIGS[family]()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return config, model


@functools.cache
def tokens(n: int = PREFIX + CONTINUE, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def forward(model, ids: torch.Tensor, start: int, cache) -> torch.Tensor:
    """Logits for `ids` at positions start.., with explicit position_ids."""
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        return model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True).logits


def continue_logits(model, cache, ids: torch.Tensor, start: int) -> torch.Tensor:
    """Logits of ids[start:] on top of `cache`: all but the last token as one chunk, then the
    last alone (the one-token decode path)."""
    end = ids.shape[1]
    chunk = forward(model, ids[:, start : end - 1], start, cache)
    step = forward(model, ids[:, end - 1 :], end - 1, cache)
    return torch.cat([chunk, step], dim=1)
