"""Every causal-LM family of transformers 5.24, built tiny, and checked through prefixd's layout.

`check(family)` builds the family from a tiny seeded config (hidden 64, 2-6 layers, vocab 1000,
CPU), prefills a prompt, exports its state at a block boundary, restores it into a fresh cache and
continues; and again from an earlier checkpoint with a replay. It reports the largest logit
difference against one full prefill, or the `LayoutError` that refused the family, or why the
family cannot be built small on CPU. Run as `python -m tests.integrations.zoo [FAMILY...]` to print
the table, or `python -m tests.integrations.zoo --write docs/families.md` to run every family and
write the table into that page (its `TABLE_START` and `TABLE_END` lines say where).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import re
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)

from prefixd.errors import LayoutError
from prefixd.integrations.transformers import capture_checkpoint, export_state, restore_state
from prefixd.integrations.transformers.layout import fresh_cache

TOL = 1e-5
VOCAB = 1000
WINDOW = 12  # sliding windows, well inside the prompts
GENERIC: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "num_hidden_layers": 4,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "is_decoder": True,
    "initializer_range": 0.02,
    # mixtures of experts: a few small experts
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_group": 1,
    "topk_group": 1,
    "vocab_size_per_layer_input": VOCAB,
}
DROP = object()  # an override that leaves the family's own default in place
MAX_PARAMETERS = 120_000_000  # past this, a config was not made small: refuse to build it
# The decoder of an encoder-decoder family, sized like the rest (as many encoder layers, so the
# cache built from the config has as many layers as the decoder).
SEQ2SEQ: dict[str, Any] = {
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "num_hidden_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
}
MLA = {
    "num_key_value_heads": 4,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "head_dim": 8,  # MLA families rotate qk_rope_head_dim dimensions of a head
}
# Families whose generic config needs more to build small (hybrid patterns that need more layers
# to hold an attention layer, MLA shapes, attributes without defaults).
OVERRIDES: dict[str, dict[str, Any]] = {
    "lfm2": {"layer_types": ["conv", "full_attention", "conv", "conv"]},
    "lfm2_moe": {
        "layer_types": ["conv", "full_attention", "conv", "full_attention"],
        "num_dense_layers": 1,
    },
    "kimi_linear": {
        "layer_types": ["linear_attention", "full_attention"] * 2,
        "q_lora_rank": None,
        "linear_head_dim": 16,
        "linear_num_heads": 4,
    },
    "gemma3_text": {"layer_types": ["sliding_attention", "full_attention"] * 2},
    "deepseek_v4": {
        "num_hidden_layers": 3,
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
        ],
        "mlp_layer_types": ["hash_moe", "moe", "moe"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "q_lora_rank": 16,
        "o_groups": 2,
        "o_lora_rank": 8,
        "index_n_heads": 2,
        "index_head_dim": 8,
        "index_topk": 256,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "hc_mult": 2,
    },
    "codegen": {"rotary_dim": 8},
    "falcon": {"head_dim": DROP},  # a property of the config
    "gptj": {"rotary_dim": 8},
    "helium": {"head_dim": 16},
    "deepseek_v2": {**MLA, "v_head_dim": 8, "q_lora_rank": None, "topk_method": "greedy"},
    "jamba": {
        "num_hidden_layers": 2,
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
        "num_experts": 2,
    },
    "mamba2": {"num_heads": 8, "head_dim": 16, "expand": 2, "n_groups": 1, "state_size": 16},
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["mamba", "attention", "mamba", "mamba"]},
    "zamba": {
        "num_hidden_layers": 6,
        "attn_layer_period": 3,
        "attn_layer_offset": 2,
        "n_mamba_heads": 2,
    },
    "zamba2": {"layers_block_type": ["mamba", "hybrid", "mamba", "hybrid"]},
    "zaya": {"num_experts_per_tok": 1},
    "gpt_neo": {"attention_types": [[["global", "local"], 2]], "window_size": WINDOW},
    "dots1": {"n_shared_experts": 1, "first_k_dense_replace": 1},
    "dbrx": {
        "d_model": 64,
        "n_heads": 4,
        "attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "musicgen": {"num_codebooks": 1},
    "musicgen_melody": {"num_codebooks": 1},
    "xmod": {"default_language": "en_XX"},
    "cohere_compass_text": {
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    },
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 16,  # below the prompt: the indexer selects, so its keys matter
        "indexer_compress_ratio": 4,
    },
    "dots3_note_text": {
        "index_n_heads": 2,
        "index_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "shared_experts_intermediate_size": 32,
        # its sliding layers are MLA layers sized by swa_* attributes
        "swa_num_attention_heads": 4,
        "swa_num_key_value_heads": 4,
        "swa_q_lora_rank": 16,
        "swa_kv_lora_rank": 16,
        "swa_head_dim": 16,
        "swa_qk_nope_head_dim": 8,
        "swa_v_head_dim": 8,
    },
    "phi4_multimodal": {
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "crop_size": 28,
        },
        "audio_config": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_blocks": 1,
            "num_attention_heads": 2,
            "ext_pw_out_channel": 32,
            "depthwise_separable_out_channel": 32,
            "nemo_conv_channels": 32,
        },
    },
    "blt": {
        name: {
            "hidden_size": 64,
            "hidden_size_global": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 128,
            "num_hidden_layers": 1,
            "head_dim": 16,
        }
        for name in ("patcher_config", "encoder_config", "decoder_config", "global_config")
    }
    | {"encoder_hash_byte_group_vocab": VOCAB},
    "prophetnet": {
        "num_hidden_layers": DROP,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
        "num_encoder_attention_heads": 4,
        "num_decoder_attention_heads": 4,
        "encoder_ffn_dim": 128,
        "decoder_ffn_dim": 128,
    },
    "reformer": {
        "num_hidden_layers": 2,
        "attn_layers": ["local", "local"],
        "attention_head_size": 16,
        "axial_pos_embds_dim": [32, 32],
        "axial_pos_shape": [16, 32],
        "local_attn_chunk_length": 16,
        "feed_forward_size": 128,
    },
    "xlnet": {
        "max_position_embeddings": DROP,  # a property that refuses: no sequence length limit
        "d_model": 64,
        "n_head": 4,
        "d_head": 16,
        "d_inner": 128,
        "n_layer": 2,
    },
    # two loops over two recurrent layers, each loop with a cache of its own ("per_loop")
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 2, "n_output_layers": 1},
    # a draft model: every layer reads the target model's keys and values
    "gemma4_assistant": {
        "hidden_size_per_layer_input": 0,
        "vocab_size_per_layer_input": 0,
        "num_kv_shared_layers": 4,
    },
    "bailing_hybrid": {"layer_group_size": 2, "num_key_value_heads": 4},
    # KV sharing: the last two layers read the first two's keys and values (DummyLayer)
    "gemma3n_text": {
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
    },
}
# Composite families whose own defaults do not validate: what their text config needs to.
COMPOSITE: dict[str, dict[str, Any]] = {
    "gemma4_assistant": {
        "text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}
    },
}
# One family per kind of cache layer and per hybrid of them: what the core run checks.
REPRESENTATIVES = {
    "llama": "full attention",
    "gemma3_text": "full + sliding",
    "mamba": "linear only (Mamba)",
    "lfm2": "short convolutions + full",
    "qwen3_next": "Gated DeltaNet + full",
    "falcon_h1": "Mamba-2 and attention in one layer",
    "nemotron_h": "Mamba-2 + full + MLP-only layers",
    "deepseek_v32": "MLA latents + DSA indexer keys",
    "qwen4_exp_text": "DSA indexer keys with a position history + Gated DeltaNet",
    "deepseek_v4": "compressed + indexer + window + compressor",
}
# The layer kinds prefixd cannot persist exactly, and the refusal that names each (docs/hybrid.md).
NOT_PERSISTABLE = (
    (
        r"a cross-attention layer",
        "cross-attention layers (mllama): their keys come from the image encoder, not the prompt",
    ),
    (
        r"keeps its state in a cache of its own",
        "a cache class of the family's own (MiniMax's lightning attention): its layout is its own",
    ),
    (
        r"keeps its recurrent state in its modules",
        "recurrent state kept in the model's modules, not in its cache (RecurrentGemma)",
    ),
    (
        r"layers a model adds to its cache as it runs",
        "cache layers a model adds as it runs, beyond its config's (Dory's per-loop copies)",
    ),
    (
        r"keeps its state outside its transformers cache, or none",
        "no state in the transformers cache at all (RWKV's own state, GPT-1 without a cache)",
    ),
)
# Families whose own transformers cache continues a chunk of several tokens inexactly (the
# Mamba-1 mixers' reference path): they are prefilled past the first chunk, and continued, one
# token at a time, which is exact.
STEPWISE = frozenset({"mamba", "falcon_mamba", "jamba"})


def documented(reason: str) -> bool:
    """Whether a refusal names one of the NOT_PERSISTABLE layer kinds."""
    return any(re.search(pattern, reason) for pattern, _ in NOT_PERSISTABLE)


@dataclasses.dataclass
class Result:
    family: str
    result: str  # "exact", "as own cache", "refused", "skipped"; "WRONG" and "ERROR" fail
    kinds: str = ""
    diff: float = float("nan")
    reason: str = ""

    def row(self) -> str:
        diff = "" if self.diff != self.diff else f"{self.diff:.1e}"
        return f"| {self.family} | {self.kinds} | {self.result} | {diff} | {self.reason} |"

    @classmethod
    def of_row(cls, row: str) -> Result:
        """The result a table row (`row()`) shows."""
        family, kinds, result, diff, reason = (
            row.removeprefix("| ").removesuffix(" |").split(" | ", 4)
        )
        return cls(family, result, kinds, float(diff) if diff else float("nan"), reason)


def families() -> list[str]:
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(family: str) -> Any:
    """The family's config made tiny; for a composite model, its text decoder's config."""
    config = AutoConfig.for_model(family, **COMPOSITE.get(family, {}))
    text = config.get_text_config(decoder=True)
    if text is not config and text.model_type != family:
        overrides = {**OVERRIDES.get(text.model_type, {}), **OVERRIDES.get(family, {})}
        return tiny_config_of(text.model_type, overrides)
    return tiny_config_of(family, OVERRIDES.get(family, {}))


def tiny_config_of(family: str, overrides: dict[str, Any]) -> Any:
    """GENERIC's values for the attributes the family's config has (others would only confuse
    readers of the config), MLA shapes for MLA families, then the family's overrides."""
    default = AutoConfig.for_model(family)
    kwargs = {k: v for k, v in GENERIC.items() if _has(default, k)}
    if _has(default, "kv_lora_rank") and default.kv_lora_rank:
        kwargs.update(MLA)
    if hasattr(default, "decoder_layers"):
        kwargs.update({k: v for k, v in SEQ2SEQ.items() if _has(default, k)})
    merged = {k: v for k, v in {**kwargs, **overrides}.items() if v is not DROP}
    config = AutoConfig.for_model(family, **merged)
    if getattr(config, "sliding_window", None) is not None:
        config.sliding_window = WINDOW
    return config


def _has(config: Any, name: str) -> bool:
    """Whether the config has the attribute as a global one (a per-layer one is left alone)."""
    try:
        getattr(config, name)
    except Exception:  # absent, or per-layer (transformers' own error class)  # noqa: BLE001
        return False
    return True


@functools.cache
def build(family: str, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    torch.manual_seed(0)
    config = tiny_config(family)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kind = _causal_lm_class(family, config)
        make = kind.from_config if kind is AutoModelForCausalLM else kind._from_config
        with torch.device("meta"):  # count first: a config not made small would not fit
            size = sum(p.numel() for p in make(config).parameters())
        if size > MAX_PARAMETERS:
            raise MemoryError(f"{size / 1e6:.0f}M parameters: its sub-configs are not made small")
        model = make(config, dtype=dtype).eval()
    return config, model


def _causal_lm_class(family: str, config: Any) -> Any:
    """AutoModelForCausalLM, or for a composite's text config its own `...ForCausalLM` class."""
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return AutoModelForCausalLM
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    for name in dir(module):
        found = getattr(module, name)
        if name.endswith("ForCausalLM") and getattr(found, "config_class", None) is type(config):
            return found
    return AutoModelForCausalLM  # raises its own error, reported as the reason


def tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def forward(model: Any, ids: torch.Tensor, start: int, cache: Any) -> torch.Tensor:
    positions = torch.arange(start, start + ids.shape[1]).unsqueeze(0)
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True)
    return out.logits  # type: ignore[no-any-return]


def continue_logits(
    model: Any, cache: Any, ids: torch.Tensor, start: int, *, stepwise: bool = False
) -> torch.Tensor:
    """Logits of ids[start:]: all but the last token as one chunk, then the last alone; or, when
    `stepwise`, one token at a time."""
    end = ids.shape[1]
    if stepwise:
        steps = [forward(model, ids[:, i : i + 1], i, cache) for i in range(start, end)]
        return torch.cat(steps, dim=1)
    chunk = forward(model, ids[:, start : end - 1], start, cache)
    return torch.cat([chunk, forward(model, ids[:, end - 1 :], end - 1, cache)], dim=1)


def kinds_of(config: Any) -> str:
    cache = fresh_cache(config)
    names = sorted({type(layer).__name__ for layer in cache.layers})
    return ", ".join(_KIND_NAMES.get(n, n) for n in names)


_KIND_NAMES = {
    "DynamicLayer": "full",
    "DynamicSlidingWindowLayer": "sliding",
    "DynamicIndexedLayer": "indexed",
    "LinearAttentionLayer": "linear",
    "LinearAttentionAndFullAttentionLayer": "linear+full",
    "LinearAttentionAndSlidingWindowAttentionLayer": "linear+sliding",
    "DummyLayer": "none",
}


def check(
    family: str,
    *,
    block: int = 8,
    page: int = 2,
    prefix_blocks: int = 6,
    tail: int = 5,
    early_blocks: int = 2,
) -> Result:
    """Export, restore and continue `family` (see the module docstring)."""
    try:
        config, model = build(family)
        kinds = kinds_of(config)
    except Exception as error:  # cannot be built small on CPU: say why  # noqa: BLE001
        return Result(family, "skipped", reason=_short(error))
    prefix, early = prefix_blocks * block, early_blocks * block
    ids = tokens(prefix + tail + 3)
    try:
        reference = forward(model, ids, 0, DynamicCache(config=config))
    except Exception as error:  # noqa: BLE001
        return _own_cache(family, config, model, ids, kinds, error)
    try:  # the model's own cache, continued: the path a restored cache takes
        own = DynamicCache(config=config)
        forward(model, ids[:, :early], 0, own)
        continue_logits(model, own, ids, early)
    except Exception as error:  # noqa: BLE001
        reason = f"transformers cannot continue this family's own cache: {_short(error)}"
        return Result(family, "skipped", kinds, reason=reason)
    try:
        chunked = _run(config, model, ids, reference, block, page, prefix, early, stepwise=False)
        if chunked[0] <= TOL:
            return Result(family, "exact", kinds, chunked[0])
        # Some families' own caches cannot be continued exactly by a chunk: try step by step.
        stepwise = _run(config, model, ids, reference, block, page, prefix, early, stepwise=True)
    except LayoutError as error:
        return Result(family, "refused", kinds, reason=str(error))
    except Exception as error:  # a bug: only LayoutError may refuse  # noqa: BLE001
        return Result(family, "ERROR", kinds, reason=_short(error))
    diff, model_diff, own_diff = chunked
    if stepwise[0] <= TOL and own_diff <= TOL:
        reason = (
            f"continued one token at a time: transformers' own cache of this family continues"
            f" a chunk {model_diff:.1e} from a prefill (the restored one {own_diff:.1e} from it)"
        )
        return Result(family, "exact", kinds, stepwise[0], reason)
    if own_diff <= TOL and stepwise[2] <= TOL:
        wide = _in_float64(family, ids, block, page, prefix, early)
        if wide is not None and wide[0] <= TOL and wide[2] <= TOL:
            reason = (
                f"in float64: transformers' own cache of this family continues {model_diff:.1e}"
                f" from a prefill in float32, {wide[1]:.1e} in float64 (rounding)"
            )
            return Result(family, "exact", kinds, wide[0], reason)
        reason = (
            f"transformers' own cache of this family continues {model_diff:.1e} from a prefill,"
            f" chunked or step by step; the restored one continues exactly like it"
        )
        return Result(family, "as own cache", kinds, diff, reason)
    return Result(family, "WRONG", kinds, diff, f"{own_diff:.1e} from the model's own cache")


def _in_float64(
    family: str, ids: torch.Tensor, block: int, page: int, prefix: int, early: int
) -> tuple[float, float, float] | None:
    """`_run` in float64, where rounding cannot hide in the model's own chunked path; None when
    the family cannot run in float64."""
    try:
        config, model = build(family, torch.float64)
        reference = forward(model, ids, 0, DynamicCache(config=config))
    except Exception:  # noqa: BLE001
        return None
    args = (config, model, ids, reference, block, page, prefix, early)
    return _run(*args, stepwise=False, dtype=torch.float64)


def _own_cache(
    family: str, config: Any, model: Any, ids: torch.Tensor, kinds: str, error: Exception
) -> Result:
    """A family that does not prefill with a DynamicCache: offer prefixd the cache it makes
    itself; it must refuse it. Skipped when the family does not prefill at all."""
    try:
        with torch.no_grad():
            out = model(input_ids=ids[:, :16], use_cache=True)
        own = next(
            (
                found
                for name in ("cache", "past_key_values", "cache_params", "past_buckets_states")
                if (found := getattr(out, name, None)) is not None
            ),
            None,
        )
    except Exception:  # noqa: BLE001
        own = None
    if own is None:
        return Result(family, "skipped", kinds, reason=f"no prefill with a cache: {_short(error)}")
    try:
        export_state(config, own, n_tokens=16, block_tokens=8)
    except LayoutError as refusal:
        return Result(family, "refused", kinds, reason=str(refusal))
    return Result(family, "ERROR", kinds, reason=f"{type(own).__name__} was exported")


def _advance(
    model: Any, cache: Any, ids: torch.Tensor, start: int, end: int, stepwise: bool
) -> None:
    """Prefill ids[start:end] on top of `cache`, as one chunk or one token at a time."""
    if end > start:
        continue_logits(model, cache, ids[:, :end], start, stepwise=stepwise)


def _run(
    config: Any,
    model: Any,
    ids: torch.Tensor,
    reference: torch.Tensor,
    block: int,
    page: int,
    prefix: int,
    early: int,
    *,
    stepwise: bool,
    dtype: torch.dtype = torch.float32,
) -> tuple[float, float, float]:
    """Prefill to `early`, capture its checkpoints, go on to `prefix`, export; restore at both
    boundaries and continue. Returns (restored vs prefill, the model's own cache vs prefill,
    restored vs own), the largest over the boundaries; the own cache has the same history."""
    cache = DynamicCache(config=config)
    forward(model, ids[:, :early], 0, cache)
    early_checkpoints = capture_checkpoint(config, cache, early, block_tokens=block)
    _advance(model, cache, ids, early, prefix, stepwise)
    state = export_state(config, cache, n_tokens=prefix, block_tokens=block, page_blocks=page)
    diffs, model_diffs, own_diffs = [], [], []
    for boundary, checkpoints in (
        (prefix, {g: c[prefix] for g, c in state.checkpoints.items()}),
        (early, early_checkpoints),
    ):
        pages = -(-(boundary // block) // page)
        restored = restore_state(
            config,
            reusable_tokens=boundary,
            block_tokens=block,
            page_blocks=page,
            paged={g: [memoryview(p) for p in ps[:pages]] for g, ps in state.paged.items()},
            checkpoints={g: memoryview(c) for g, c in checkpoints.items()},
            dtype=dtype,
        )
        logits = continue_logits(model, restored, ids, boundary, stepwise=stepwise)
        own = DynamicCache(config=config)
        forward(model, ids[:, :early], 0, own)
        _advance(model, own, ids, early, boundary, stepwise)
        own_logits = continue_logits(model, own, ids, boundary, stepwise=stepwise)
        diffs.append((logits - reference[:, boundary:]).abs().max().item())
        model_diffs.append((own_logits - reference[:, boundary:]).abs().max().item())
        own_diffs.append((logits - own_logits).abs().max().item())
    return max(diffs), max(model_diffs), max(own_diffs)


def prefill_and_export(
    family: str, n_tokens: int, block: int, page: int, dtype: torch.dtype = torch.float32
) -> tuple[Any, Any]:
    """The cache after a prefill of `n_tokens` tokens, and its exported state."""
    config, model = build(family, dtype)
    cache = DynamicCache(config=config)
    forward(model, tokens(n_tokens), 0, cache)
    state = export_state(config, cache, n_tokens=n_tokens, block_tokens=block, page_blocks=page)
    return cache, state


def restore_and_continue(
    family: str,
    state: Any,
    n_tokens: int,
    ids: torch.Tensor,
    block: int,
    page: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    config, model = build(family, dtype)
    restored = restore_state(
        config,
        reusable_tokens=n_tokens,
        block_tokens=block,
        page_blocks=page,
        paged=state.paged,
        checkpoints={g: c[n_tokens] for g, c in state.checkpoints.items()},
        dtype=dtype,
    )
    return continue_logits(model, restored, ids, n_tokens)


def zeroing_diffs(
    family: str, block: int = 8, page: int = 2, n_tokens: int = 48
) -> dict[str, float]:
    """For each stored group, how far zeroing its payloads moves the continued logits."""
    from prefixd.integrations.transformers.fields import pack_described, unpack_described

    config, model = build(family)
    ids = tokens(n_tokens + 8)
    reference = forward(model, ids, 0, DynamicCache(config=config))[:, n_tokens:]
    _, state = prefill_and_export(family, n_tokens, block, page)
    out = {}
    for group in [*state.paged, *state.checkpoints]:
        zeroed = dataclasses.replace(
            state,
            paged={
                g: [bytes(len(p)) if g == group else p for p in ps] for g, ps in state.paged.items()
            },
            checkpoints=dict(state.checkpoints),
        )
        if group in state.checkpoints:
            payload = state.checkpoints[group][n_tokens]
            tensors = unpack_described(payload, group)  # keep the header, zero the tensors
            blank = pack_described({k: torch.zeros_like(t) for k, t in tensors.items()})
            zeroed.checkpoints[group] = {n_tokens: blank}
        logits = restore_and_continue(family, zeroed, n_tokens, ids, block, page)
        out[group] = (logits - reference).abs().max().item()
    return out


def _short(error: BaseException) -> str:
    text = re.sub(r"\s+", " ", f"{type(error).__name__}: {error}")
    return text[:160]


TABLE_HEAD = "| family | cache layers | result | max abs dlogits | reason |\n|---|---|---|---|---|"
# docs/families.md shows a whole run between these two lines, as `--write` writes it.
TABLE_START = (
    "<!-- the families table, written by: python -m tests.integrations.zoo --write PAGE -->"
)
TABLE_END = "<!-- the end of the families table -->"


def summary(results: Sequence[Result], day: str) -> str:
    """The line above the table: the run's day, the transformers it ran and its counts."""
    count = {kind: sum(r.result == kind for r in results) for kind in ("exact", "as own cache")}
    refused = sum(r.result == "refused" for r in results)
    skipped = sum(r.result == "skipped" for r in results)
    return (
        f"The table of {day} (transformers {transformers.__version__}, on CPU):"
        f" {count['exact']} exact, {count['as own cache']} as its own cache,"
        f" {refused} refused for a documented reason, {skipped} skipped."
    )


def write_table(page: Path, results: Sequence[Result]) -> None:
    """Replace the table of `page` (between TABLE_START and TABLE_END) with `results`."""
    text = page.read_text()
    start, end = text.index(TABLE_START), text.index(TABLE_END) + len(TABLE_END)
    day = datetime.date.today().isoformat()
    rows = [r.row() for r in results]
    table = "\n".join([TABLE_START, summary(results, day), "", TABLE_HEAD, *rows, TABLE_END])
    page.write_text(text[:start] + table + text[end:])


def main(argv: list[str]) -> None:
    import transformers.utils.logging as transformers_logging

    transformers_logging.set_verbosity_error()
    page = Path(argv[1]) if argv[:1] == ["--write"] and len(argv) == 2 else None
    print(TABLE_HEAD)
    results = []
    for family in families() if page is not None else argv or families():
        results.append(check(family))
        print(results[-1].row(), flush=True)
    if page is not None:
        write_table(page, results)


if __name__ == "__main__":
    main(sys.argv[1:])
