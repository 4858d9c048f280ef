"""The prefixd identity of a vLLM engine, taken from vLLM's own config (never typed by hand).

vLLM's block keys already cover the tokens, the LoRA adapter a request uses, its multimodal
inputs and its cache salt (they are chained into vLLM's block hashes). What they do not cover is
everything that changes the KV those tokens produce; each field's source:

  model       ModelConfig.model (a hub name or a local path)
  weights     ModelConfig.revision, and for a local model the fingerprint of its files
              (config.json and the safetensors index, or the weight files themselves; the same
              function as the daemon's --model-manifests, prefixd.schema.fingerprint)
  tokenizer   ModelConfig.tokenizer, tokenizer_revision and tokenizer_mode
  template    the chat template: the fingerprint of the model's chat_template.jinja and
              tokenizer_config.json where the model is local, else the hub revision
  rope        the HF config's rope_scaling / rope_parameters, rope_theta, max_position_embeddings,
              and ModelConfig.max_model_len when rope scaling is set (it then sets positions)
  kv_layout   ModelConfig.dtype, CacheConfig.cache_dtype and prefix_caching_hash_algo (the keys'
              hash) here; the tier adds what vLLM's
              offloading config says: the KV dtype, bytes per block, block and chunk size,
              tensor / pipeline / context parallel sizes and layout, and the KV group
  adapter     LoRAConfig (max_loras, max_lora_rank, lora_dtype) when LoRA is enabled, else None
  mm          the multimodal config (processor kwargs, limits) for a multimodal model, else None
  tenant      the tier's `tenant` setting

`engine_fields(vllm_config)` computes them in the process that builds the engine, where the
VllmConfig is at hand (vLLM hands a secondary tier only its offloading config);
`prefixd.integrations.vllm.kv_transfer_config` passes them to the tier.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prefixd.schema.fingerprint import fingerprint_files

# What engine_fields returns: the identity fields the tier cannot read from its offloading config.
FIELDS = ("model", "weights", "tokenizer", "template", "rope", "kv_layout", "adapter", "mm")
_ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")


def engine_fields(vllm_config: Any) -> dict[str, str | None]:
    """The identity fields of the engine `vllm_config` (a vllm.config.VllmConfig) describes."""
    model_config = vllm_config.model_config
    model = str(model_config.model)
    local = Path(model) if Path(model).is_dir() else None
    revision = model_config.revision or "main"
    weights = f"rev={revision}" if local is None else f"local:{_weights_fingerprint(local)}"
    tokenizer_revision = model_config.tokenizer_revision or revision
    tokenizer = f"{model_config.tokenizer}@{tokenizer_revision} mode={model_config.tokenizer_mode}"
    return {
        "model": model,
        "weights": weights,
        "tokenizer": tokenizer,
        "template": _template(local, revision),
        "rope": _rope(model_config),
        "kv_layout": "dtype={} cache={} keys={}".format(
            str(model_config.dtype).removeprefix("torch."),
            vllm_config.cache_config.cache_dtype,
            getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"),
        ),
        "adapter": _adapter(vllm_config.lora_config),
        "mm": _multimodal(model_config),
    }


def _weights_fingerprint(local: Path) -> str:
    indexes = sorted(local.glob("*.safetensors.index.json")) + sorted(
        local.glob("*.bin.index.json")
    )
    weights = indexes or sorted(local.glob("*.safetensors")) or sorted(local.glob("*.bin"))
    return fingerprint_files([local / "config.json", *weights])


def _template(local: Path | None, revision: str) -> str:
    if local is None:
        return f"rev={revision}"
    files = [local / "chat_template.jinja", local / "tokenizer_config.json"]
    return fingerprint_files([path for path in files if path.exists()] or files[:1])


def _rope(model_config: Any) -> str:
    hf = model_config.hf_config
    text = getattr(hf, "get_text_config", lambda: hf)()
    rope = {key: getattr(text, key, None) for key in _ROPE_KEYS}
    if _scaled(rope["rope_scaling"]) or _scaled(rope["rope_parameters"]):
        rope["max_model_len"] = model_config.max_model_len
    return _canonical(rope)


def _scaled(parameters: object) -> bool:
    """Whether rope parameters (rope_scaling, or transformers' rope_parameters, per layer type or
    not) scale positions."""
    if not isinstance(parameters, dict):
        return False
    layers = (
        parameters.values()
        if all(isinstance(v, dict) for v in parameters.values())
        else [parameters]
    )
    return any(
        layer.get("rope_type", layer.get("type", "default")) not in ("default", None)
        for layer in layers
    )


def _adapter(lora_config: Any) -> str | None:
    if lora_config is None:
        return None
    return "lora " + _canonical(
        {
            "max_loras": getattr(lora_config, "max_loras", None),
            "max_lora_rank": getattr(lora_config, "max_lora_rank", None),
            "lora_dtype": str(getattr(lora_config, "lora_dtype", None)),
        }
    )


def _multimodal(model_config: Any) -> str | None:
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None:
        return None
    return "mm " + _canonical(
        {
            "processor": getattr(mm, "mm_processor_kwargs", None),
            "limits": getattr(mm, "limit_per_prompt", None),
        }
    )


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


__all__ = ["FIELDS", "engine_fields"]
