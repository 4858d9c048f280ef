"""A tiny seeded Llama model directory for a real vLLM CPU engine (runs in the vLLM venv only).

`build_tiny_model(path)` writes `config.json` and `model.safetensors` with `save_pretrained`:
float32 weights drawn from a seeded generator, so every process (and every rebuild) gets
byte-identical files and the same greedy output. No tokenizer is written: the engine runs with
`skip_tokenizer_init=True` and token-id prompts. The shape meets what vLLM's CPU attention needs
(head size 32 or more; the KV block size, set on the engine, a multiple of 32).

Keyword overrides go to `LlamaConfig`, so a test can build a variant of the same model, e.g.
`build_tiny_model(p, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})`
or `build_tiny_model(p, max_position_embeddings=1024)`. `seed` changes the weights only.

`write_lora_adapter(path, weights)` writes a LoRA adapter's files as PEFT names them: what the
identity fingerprints, not an adapter vLLM could apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 2048
DEFAULTS: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2048,
    # Wider than the usual 0.02, so the logits are peaked and greedy decoding has no near-ties.
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}


def build_tiny_model(path: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write a tiny seeded LlamaForCausalLM to `path` (created if missing) and return it."""
    path = Path(path)
    config = LlamaConfig(**{**DEFAULTS, **overrides})
    torch.manual_seed(seed)
    with torch.no_grad():
        model = LlamaForCausalLM(config).to(torch.float32)
        # Draw every tensor again from one generator, in name order, so the weights depend only on
        # the seed and the shapes, not on transformers' own initialisation order.
        generator = torch.Generator().manual_seed(seed)
        std = config.initializer_range
        for name, tensor in sorted(model.state_dict().items()):
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) * std)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path


def write_lora_adapter(path: Path, weights: bytes) -> Path:
    """A LoRA adapter's config and weights file at `path` (created if missing, files rewritten in
    place), holding `weights`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


if __name__ == "__main__":
    import sys

    print(build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else "/tmp/prefixd-tiny-llama"))
