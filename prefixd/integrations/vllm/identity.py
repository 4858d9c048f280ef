"""The prefixd identity of a vLLM engine, taken from vLLM's own config (never typed by hand).

vLLM's block hashes already chain the tokens, a request's LoRA adapter (its name and path, not its
files), multimodal inputs and cache salt; the identity adds what else changes the KV those tokens
produce. Each field's source:

  model, weights  ModelConfig.model and revision, the revision as the commit it named when vLLM
                  read the config (Hugging Face's cache: a branch such as `main` moves); a local
                  model's weight files' fingerprint (a GGUF file's own); `weights` as given
                  ("given:..."), which a model streamed from object storage needs
                  (ModelConfig.model_weights: only its config files are local), as does any
                  other whose weights prefixd cannot name (never a default)
  tokenizer       ModelConfig.tokenizer, tokenizer_revision and tokenizer_mode
  template        a local model's chat_template.jinja and tokenizer_config.json, else the revision
                  (as the commit)
  rope            the HF config's RoPE settings, and max_model_len when scaling sets positions
  kv_layout       ModelConfig.dtype, quantization (online, as --quantization fp8, or the
                  checkpoint's), hf_overrides other than RoPE's, cache_dtype and the keys' hash;
                  the tier adds what vLLM's offloading config says of the KV (group_identities),
                  each group's layers by name and in order among it
  adapter, mm     the LoRA and multimodal configs, None without them; the LoRA adapters `vllm serve`
                  names (--lora-modules: `lora_modules`), each by the fingerprint of its files
                  where they are local (vLLM's keys name an adapter by name and path only); a
                  local model's preprocessing files (preprocessor_config.json and the like)
  tenant          the tier's `tenant` setting

`engine_fields` runs where the VllmConfig is at hand (`kv_transfer_config`): vLLM hands a secondary
tier only its offloading config.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from prefixd.errors import ConfigError
from prefixd.integrations.identity import (
    digest_of,
    identity_of,
    local_preprocessing,
    local_weights,
    weight_files,
)
from prefixd.integrations.vllm.chains import KEY_BYTES
from prefixd.schema.fingerprint import fingerprint_files
from prefixd.schema.identity import Identity

# What engine_fields returns: the identity fields the tier cannot read from its offloading config.
FIELDS = ("model", "weights", "tokenizer", "template", "rope", "kv_layout", "adapter", "mm")
_GIVE_WEIGHTS = "kv_transfer_config(..., weights=...), or --weights"
_ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "max_position_embeddings")
# MultiModalConfig fields that change an item's embeddings (the encoder's attention dtype and fp8
# scales, normalizing on the device, which video tokens are pruned) or what a prompt may hold.
_MM_SETTINGS = (
    "mm_processor_kwargs",
    "limit_per_prompt",
    "media_io_kwargs",
    "mm_encoder_attn_dtype",
    "mm_encoder_fp8_scale_path",
    "mm_device_do_normalize",
    "video_pruning_rate",
    "video_pruning_method",
)


def engine_fields(
    vllm_config: Any,
    weights: str | None = None,
    lora_modules: Mapping[str, str] | None = None,
) -> dict[str, str | None]:
    """The identity fields of the engine `vllm_config` (a vllm.config.VllmConfig) describes,
    with `weights` (a revision or digest) as the weights' identity when given, and the LoRA
    adapters it serves (`lora_modules`, name: path). ConfigError for a model whose weights are
    streamed from object storage without `weights`: prefixd cannot read them, and a checkpoint
    replaced there keeps its config."""
    model_config = vllm_config.model_config
    model = str(model_config.model)
    local = Path(model) if Path(model).is_dir() else None
    revision = model_config.revision or "main"
    commit = None if local is not None else _commit(model, revision)
    pinned = commit or revision
    streamed = getattr(model_config, "model_weights", "")
    if weights is not None:
        weights = f"given:{weights}"
    elif streamed and streamed != model:
        raise ConfigError(
            f"prefixd: the weights of this engine are streamed from {streamed}, where prefixd "
            "cannot fingerprint them (the model's local directory holds its config alone, the "
            "same for a checkpoint replaced there): give their revision or digest "
            f"({_GIVE_WEIGHTS})"
        )
    elif local is not None:
        weights = local_weights(local)
    elif Path(model).is_file():  # a GGUF file: its weights, tokenizer and template in one
        weights = "local:" + fingerprint_files([Path(model)])
    elif commit is not None:
        weights = f"rev={commit}"
    else:
        raise ConfigError(
            f"prefixd: cannot tell which weights {model!r} (revision {revision!r}) are: it is "
            "no local directory or file, and no Hugging Face model whose revision this "
            "machine's cache names (ModelScope, a GGUF repo's quantization, another hub), so "
            "a checkpoint replaced under that name would be served the old one's KV: give "
            f"their revision or digest ({_GIVE_WEIGHTS})"
        )
    tokenizer_revision = model_config.tokenizer_revision or revision
    tokenizer = f"{model_config.tokenizer}@{tokenizer_revision} mode={model_config.tokenizer_mode}"
    return {
        "model": model,
        "weights": weights,
        "tokenizer": tokenizer,
        "template": _template(local, pinned),
        "rope": _rope(model_config),
        "kv_layout": "dtype={} quant={} overrides={} cache={} keys={}".format(
            str(model_config.dtype).removeprefix("torch."),
            model_config.quantization,
            _overrides(model_config),
            vllm_config.cache_config.cache_dtype,
            getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"),
        ),
        "adapter": _adapter(vllm_config.lora_config, lora_modules or {}),
        "mm": _multimodal(model_config, local),
    }


def group_identities(
    config: Any, fields: Mapping[str, str | None], tenant: str, placement: str
) -> dict[int, Identity]:
    """One engine-keyed identity per KV group: the engine's fields, with what vLLM's offloading
    config says about the KV and `placement` (how a payload's bytes are laid out: the tier's row,
    the direct spec's rank) added to `kv_layout`. ConfigError when `fields` were written for
    another model than the engine serves (a kv_transfer_config copied to another engine)."""
    _check_model(str(fields["model"]), config.model.name)
    parallel = config.parallel
    layout = (
        f"{fields['kv_layout']} kv={config.model.dtype} {placement} "
        f"worker_block={config.worker_kv_bytes_per_block}"
        f" hash_tokens={config.cache.tokens_per_hash}"
        f" chunk_blocks={config.cache.blocks_per_chunk} world={parallel.world_size}"
        f" tp={parallel.tp_size} pp={parallel.pp_size} pcp={parallel.pcp_size}"
        f" dcp={parallel.dcp_size} layout={config.kv_cache_layout}"
        f" canonical={config.canonical_layout} replicated={config.replicated_layout}"
    )
    base = identity_of(
        fields,
        kv_layout=layout,
        block_tokens=1,
        tenant=tenant,
        key_bytes=KEY_BYTES,
    )
    return {
        group.group_id: replace(
            base,
            kv_layout=f"{layout} group={group.group_id} layers={_layers(group.layer_names)}",
            block_tokens=group.tokens_per_block * config.cache.blocks_per_chunk,
        )
        for group in config.groups
    }


def _layers(names: Sequence[str]) -> str:
    """A group's layers, in the order its payloads hold them: their count and a digest of their
    names (the same count of other layers, or another order, is other bytes)."""
    return f"{len(names)}:" + digest_of("\n".join(names))


def _check_model(written_for: str, served: str) -> None:
    same = written_for == served or (
        Path(written_for).is_dir() and Path(served).is_dir() and Path(written_for).samefile(served)
    )
    if not same:
        raise ConfigError(
            f"prefixd: the identity in kv_transfer_config was written for model {written_for!r}, "
            f"but this engine serves {served!r}: its KV would be stored and served as the other "
            "model's; write this engine's with prefixd.integrations.vllm.kv_transfer_config"
        )


def _commit(model: str, revision: str) -> str | None:
    """The commit `revision` of the hub model `model` names in Hugging Face's cache, where vLLM
    has just read the model's config, resolved as huggingface_hub resolves it (None: not in the
    cache, as no URI or GGUF repo's "id:quantization" is, or huggingface_hub is missing)."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    repo = Path(constants.HF_HUB_CACHE) / ("models--" + model.replace("/", "--"))
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    return commit if commit and (repo / "snapshots" / commit).is_dir() else None


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


def _overrides(model_config: Any) -> str:
    """The HF config overrides other than RoPE's (`rope` holds those): a sliding window or a layer
    count set there changes the KV as a config file's would; a function, by its name."""
    overrides = getattr(model_config, "hf_overrides", None) or {}
    if callable(overrides):
        return f"{overrides.__module__}.{overrides.__qualname__}"
    return _canonical({k: v for k, v in overrides.items() if k not in _ROPE_KEYS})


def _scaled(parameters: object) -> bool:
    """Whether rope parameters (per layer type or not) scale positions: max_model_len then
    sets them."""
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


def _adapter(lora_config: Any, modules: Mapping[str, str]) -> str | None:
    """The LoRA config, and each adapter of `modules` by its files: vLLM's keys name an adapter
    by its name and path, which stay the same when its files are replaced in place."""
    if lora_config is None:
        return None
    settings: dict[str, object] = {
        "max_loras": getattr(lora_config, "max_loras", None),
        "max_lora_rank": getattr(lora_config, "max_lora_rank", None),
        "lora_dtype": str(getattr(lora_config, "lora_dtype", None)),
    }
    if modules:  # of every adapter's fingerprint: the names and files of many outgrow the field
        files = _canonical({name: _lora_files(path) for name, path in modules.items()})
        settings["modules"] = "sha256:" + hashlib.sha256(files.encode()).hexdigest()
    return "lora " + _canonical(settings)


def _lora_files(path: str) -> str:
    """A LoRA adapter's identity: the fingerprint of its config and weights where they are
    local, else its path (a hub id vLLM downloads when it first loads it)."""
    local = Path(path)
    if not local.is_dir():
        return f"path={path}"
    return fingerprint_files([local / "adapter_config.json", *weight_files(local)])


def _multimodal(model_config: Any, local: Path | None) -> str | None:
    """What turns a multimodal item into embeddings: vLLM's settings of it (an item's hash covers
    its data and the processor kwargs only) and a local model's preprocessing files."""
    mm = getattr(model_config, "multimodal_config", None)
    if mm is None:
        return None
    settings = {name: getattr(mm, name, None) for name in _MM_SETTINGS}
    if local is not None:
        settings["files"] = local_preprocessing(local)
    return "mm " + _canonical(settings)


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str, separators=(",", ":"))


__all__ = ["FIELDS", "engine_fields", "group_identities"]
