"""Restore each model family's prefix state from a running daemon and continue: run as
`python -m tests.integrations.restore_from_daemon SOCKET` in a fresh process (nothing of the
storing process survives); prints one JSON line per family with the measured logit differences.

Two prompts per family: the stored one (the joint hit covers all of it) and one that leaves it
inside block 4 (the hit falls back to an earlier boundary, and the engine replays from there).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch
from transformers import DynamicCache

from prefixd import Identity
from prefixd.client import Client, StateLoaded
from prefixd.integrations.transformers import restore_state, state_spec

from .models import BLOCK, FAMILIES, PAGE, build, continue_logits, forward, tokens

DIVERGE = 36  # the second prompt's first token that differs from the stored prompt


def identity_for(family: str, config, tokenizer: str = "test-vocab-128") -> Identity:
    return Identity(
        model=family,
        weights="seed-0",
        tokenizer=tokenizer,
        template="none",
        rope="default",
        kv_layout="float32",
        block_tokens=BLOCK,
        tenant="tests",
        state=state_spec(config, block_tokens=BLOCK, page_blocks=PAGE),
    )


def diverging_prompt() -> torch.Tensor:
    ids = tokens().clone()
    other = tokens(seed=2)
    ids[0, DIVERGE:] = other[0, DIVERGE:]
    ids[0, DIVERGE] = (tokens()[0, DIVERGE] + 1) % 128
    return ids


def as_ids(ids: torch.Tensor) -> np.ndarray:
    return ids[0].numpy().astype(np.uint32)


def restore_and_continue(family: str, client: Client, ids: torch.Tensor) -> dict[str, float]:
    config, model = build(family)
    loaded: StateLoaded = client.load_state(identity_for(family, config), as_ids(ids))
    reusable = loaded.reusable_tokens
    groups = loaded.by_group()
    cache = restore_state(
        config,
        reusable_tokens=reusable,
        block_tokens=BLOCK,
        page_blocks=PAGE,
        paged={g: [p.view for p in parts] for g, parts in groups.items() if parts[0].tokens},
        checkpoints={g: parts[0].view for g, parts in groups.items() if not parts[0].tokens},
    )
    logits = continue_logits(model, cache, ids, reusable)  # replays [reusable, PREFIX) too
    reference = forward(model, ids, 0, DynamicCache(config=config))
    diff = (logits - reference[:, reusable:]).abs().max().item()
    return {"reusable_tokens": reusable, "paged_tokens": loaded.paged_tokens, "diff": diff}


def main(socket_path: str, *families: str) -> None:
    """Every family of tests.integrations.models, or the ones named."""
    with Client(socket_path, region_bytes=16 << 20) as client:
        for family in families or FAMILIES:
            result = {
                "family": family,
                "direct": restore_and_continue(family, client, tokens()),
                "replay": restore_and_continue(family, client, diverging_prompt()),
            }
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
