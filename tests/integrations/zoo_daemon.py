"""The families of `zoo` through a daemon: store a prefix's state, restore it in a fresh process.

`store(client, family)` prefills the prompt in two chunks, capturing a checkpoint at EARLY, and puts
every group up to PREFIX. Run `python -m tests.integrations.zoo_daemon SOCKET FAMILY...` in a fresh
process (nothing of the storing one survives) to load, restore and continue each family, for the
stored prompt and for one that leaves it inside block 4; it prints one JSON line per family.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
from transformers import DynamicCache

from prefixd import Identity
from prefixd.client import Client
from prefixd.integrations.transformers import capture_checkpoint, export_state, restore_state

from . import restore_from_daemon, zoo

BLOCK, PAGE = restore_from_daemon.BLOCK, restore_from_daemon.PAGE
EARLY, PREFIX, TOTAL = 24, 64, 72
DIVERGE = 36  # the second prompt's first token that differs from the stored one
STEPWISE = zoo.STEPWISE


def identity_for(family: str, config: Any) -> Identity:
    return restore_from_daemon.identity_for(family, config, tokenizer="test-vocab-1000")


def prompts() -> dict[str, torch.Tensor]:
    stored = zoo.tokens(TOTAL)
    other = stored.clone()
    other[0, DIVERGE:] = zoo.tokens(TOTAL, seed=2)[0, DIVERGE:]
    other[0, DIVERGE] = (stored[0, DIVERGE] + 1) % zoo.VOCAB
    return {"direct": stored, "replay": other}


def as_ids(ids: torch.Tensor) -> np.ndarray:
    return ids[0].numpy().astype(np.uint32)


def store(client: Client, family: str) -> int:
    """Put the stored prompt's state up to PREFIX, with checkpoints at EARLY and PREFIX."""
    config, model = zoo.build(family)
    ids = prompts()["direct"]
    cache = DynamicCache(config=config)
    zoo.forward(model, ids[:, :EARLY], 0, cache)
    early = capture_checkpoint(config, cache, EARLY, block_tokens=BLOCK)
    zoo.continue_logits(model, cache, ids[:, :PREFIX], EARLY, stepwise=family in STEPWISE)
    state = export_state(config, cache, n_tokens=PREFIX, block_tokens=BLOCK, page_blocks=PAGE)
    checkpoints = {g: {EARLY: early[g], **late} for g, late in state.checkpoints.items()}
    stored = client.put_state(
        identity_for(family, config),
        as_ids(ids),
        upto_tokens=PREFIX,
        paged=state.paged,
        checkpoints=checkpoints,
    )
    return int(stored.stored)


def restore_and_continue(client: Client, family: str, ids: torch.Tensor) -> dict[str, float]:
    config, model = zoo.build(family)
    loaded = client.load_state(identity_for(family, config), as_ids(ids))
    try:
        groups = loaded.by_group()
        cache = restore_state(
            config,
            reusable_tokens=loaded.reusable_tokens,
            block_tokens=BLOCK,
            page_blocks=PAGE,
            paged={g: [p.view for p in parts] for g, parts in groups.items() if parts[0].tokens},
            checkpoints={g: parts[0].view for g, parts in groups.items() if not parts[0].tokens},
        )
    finally:
        loaded.release()  # restore_state copied what it needs
    reusable = loaded.reusable_tokens
    stepwise = family in STEPWISE
    logits = zoo.continue_logits(model, cache, ids, reusable, stepwise=stepwise)
    reference = zoo.forward(model, ids, 0, DynamicCache(config=config))[:, reusable:]
    # The model's own cache with the history the stored state had, continued the same way.
    own = DynamicCache(config=config)
    first = min(EARLY, reusable)
    zoo.forward(model, ids[:, :first], 0, own)
    if reusable > first:
        zoo.continue_logits(model, own, ids[:, :reusable], first, stepwise=stepwise)
    own_logits = zoo.continue_logits(model, own, ids, reusable, stepwise=stepwise)
    return {
        "reusable_tokens": reusable,
        "diff": (logits - reference).abs().max().item(),
        "own_diff": (logits - own_logits).abs().max().item(),
        "model_diff": (own_logits - reference).abs().max().item(),
    }


def main(socket_path: str, families: list[str]) -> None:
    with Client(socket_path, region_bytes=32 << 20) as client:
        for family in families:
            result: dict[str, Any] = {"family": family}
            for name, ids in prompts().items():
                result[name] = restore_and_continue(client, family, ids)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    import transformers.utils.logging as transformers_logging

    transformers_logging.set_verbosity_error()
    main(sys.argv[1], sys.argv[2:])
