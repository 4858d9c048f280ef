"""A tiny multimodal model (LLaVA: a CLIP vision tower and a Llama decoder) from a seeded config,
its processor's inputs for a prompt with one image, and its prefix state through a daemon: run as
`python -m tests.integrations.multimodal SOCKET` in a fresh process, it restores what the storing
process put, continues, and prints one JSON line per image it asks with.

The prompt is 16 text tokens, the image's 16 placeholders (blocks 2 and 3), then 16 text tokens;
the continuation is 16 more. "cat" is the stored image: it restores the whole prefix. "dog" has the
same token ids: its hit must end where the image begins, and the model prefills the rest.
"""

from __future__ import annotations

import functools
import json
import sys

import torch
from transformers import (
    CLIPVisionConfig,
    DynamicCache,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
)

from prefixd import Identity
from prefixd.client import Client
from prefixd.integrations.transformers import prompt_of, restore_state, state_spec

BLOCK = 8
IMAGE_TOKEN = 120
IMAGE_AT, IMAGE_TOKENS = 16, 16  # a 32x32 image in 8x8 patches
PREFIX = 48
TOTAL = PREFIX + 16
TOL = 1e-5


@functools.cache
def build() -> tuple[LlavaConfig, LlavaForConditionalGeneration]:
    torch.manual_seed(0)
    text = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        max_position_embeddings=256,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_hidden_layers=2,
        image_size=32,
        patch_size=8,
        projection_dim=32,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=IMAGE_TOKEN,
        vision_feature_layer=-1,
    )
    return config, LlavaForConditionalGeneration(config).eval()


def inputs(image: str) -> dict[str, torch.Tensor]:
    """What a processor gives for the prompt with `image` ("cat", "dog"): the same token ids."""
    ids = torch.randint(0, 100, (1, TOTAL), generator=torch.Generator().manual_seed(1))
    ids[0, IMAGE_AT : IMAGE_AT + IMAGE_TOKENS] = IMAGE_TOKEN
    seed = {"cat": 2, "dog": 3}[image]
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def identity(config: LlavaConfig) -> Identity:
    return Identity(
        model="tiny-llava",
        weights="seed-0",
        tokenizer="test-vocab-128",
        template="none",
        rope="default",
        kv_layout="float32",
        block_tokens=BLOCK,
        tenant="tests",
        mm="clip-32px@1",
        request_content=True,
        state=state_spec(config, block_tokens=BLOCK),
    )


def forward(model, batch: dict[str, torch.Tensor], start: int, end: int, cache) -> torch.Tensor:
    """Logits of tokens [start, end) on top of `cache`, with the image's pixels when its
    placeholders are among them."""
    ids = batch["input_ids"][:, start:end]
    extra = {"pixel_values": batch["pixel_values"]} if (ids == IMAGE_TOKEN).any() else {}
    with torch.no_grad():
        return model(
            input_ids=ids,
            cache=cache,
            use_cache=True,
            cache_position=torch.arange(start, end),
            **extra,
        ).logits


def restore_and_continue(client: Client, image: str) -> dict[str, float]:
    config, model = build()
    batch = inputs(image)
    prompt = prompt_of(batch, config)
    loaded = client.load_state(identity(config), prompt)
    reusable = loaded.reusable_tokens
    groups = loaded.by_group()
    cache = restore_state(
        config,
        reusable_tokens=reusable,
        block_tokens=BLOCK,
        paged={g: [p.view for p in parts] for g, parts in groups.items()},
        checkpoints={},
    )
    logits = forward(model, batch, reusable, TOTAL, cache)
    reference = forward(model, batch, 0, TOTAL, DynamicCache(config=config))
    diff = (logits - reference[:, reusable:]).abs().max().item()
    return {"image": image, "reusable_tokens": reusable, "diff": diff}


def store(client: Client, image: str) -> int:
    """Prefill PREFIX tokens with `image` and put their state; the blocks stored."""
    from prefixd.integrations.transformers import export_state

    config, model = build()
    batch = inputs(image)
    cache = DynamicCache(config=config)
    forward(model, batch, 0, PREFIX, cache)
    payloads = export_state(config, cache, n_tokens=PREFIX, block_tokens=BLOCK)
    prompt = prompt_of(batch, config)
    stored = client.put_state(
        identity(config), prompt, upto_tokens=PREFIX, paged=payloads.paged, checkpoints={}
    )
    return stored.stored


def main(socket_path: str, *images: str) -> None:
    with Client(socket_path, region_bytes=16 << 20) as client:
        for image in images or ("cat", "dog"):
            print(json.dumps(restore_and_continue(client, image)), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
