"""The multimodal row of the poison suite: the same placeholder token ids with another image.

Run from the repository root in the core venv (it needs transformers):

    .venv/bin/python bench/poison_mm.py [--json]

A tiny LLaVA (tests/integrations/multimodal.py) prefills a prompt with image "cat" and puts its
state into a daemon, the daemon restarts, and the prompt with image "dog" (the same token ids) is
restored and continued: "exact" if its logits equal a full prefill with "dog", "wrong" if the
restored state was cat's. Then the same through a chain over token ids alone (what a cache keyed
by the prompt's token ids does; prefixd's own chain before per-request content), in-process.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

import numpy as np
from poisonlib import Outcome, Row, main
from suitelib import SuiteDaemon
from transformers import DynamicCache

from prefixd import Store
from prefixd.client import Client
from prefixd.integrations.transformers import export_state, restore_state
from tests.integrations import multimodal as mm


def through_prefixd(root: Path) -> Outcome:
    with SuiteDaemon(root, "poison-mm", map_size=1 << 30) as daemon:
        with Client(daemon.socket, region_bytes=16 << 20) as client:
            mm.store(client, "cat")
        daemon.restart()
        with Client(daemon.socket, region_bytes=16 << 20) as client:
            dog = mm.restore_and_continue(client, "dog")
    return "exact" if dog["diff"] <= mm.TOL else "wrong"


def by_token_ids(root: Path) -> Outcome:
    """The same put and restore keyed by token ids alone (an identity without request content,
    used in-process: the daemon refuses it for a multimodal model)."""
    config, model = mm.build()
    blind = replace(mm.identity(config), mm=None, request_content=False)
    cat, dog = mm.inputs("cat"), mm.inputs("dog")
    tokens = cat["input_ids"][0].numpy().astype(np.uint32)
    cache = DynamicCache(config=config)
    mm.forward(model, cat, 0, mm.PREFIX, cache)
    payloads = export_state(config, cache, n_tokens=mm.PREFIX, block_tokens=mm.BLOCK)
    with Store.open(root / "blind", map_size=1 << 30) as store:
        store.put_state(blind, tokens, paged=payloads.paged, upto_tokens=mm.PREFIX)
        out = bytearray(16 << 20)
        loaded = store.load_state(blind, tokens, out)
    reusable = loaded.match.reusable_tokens
    pages = [bytes(out[o : o + p.payload_size]) for o, p in zip(loaded.offsets, loaded.match.parts)]
    group = loaded.match.parts[0].group
    restored = restore_state(
        config,
        reusable_tokens=reusable,
        block_tokens=mm.BLOCK,
        paged={group: pages},
        checkpoints={},
    )
    logits = mm.forward(model, dog, reusable, mm.TOTAL, restored)
    reference = mm.forward(model, dog, 0, mm.TOTAL, DynamicCache(config=config))
    diff = (logits - reference[:, reusable:]).abs().max().item()
    return "exact" if diff <= mm.TOL else "wrong"


def rows() -> list[Row]:
    with tempfile.TemporaryDirectory(prefix="poison-mm-") as tmp:
        root = Path(tmp)
        return [
            Row(
                "multimodal: the same placeholder ids with another image",
                "a chain over token ids alone",
                through_prefixd(root),
                by_token_ids(root),
                "token-id keys",
            )
        ]


if __name__ == "__main__":
    main(rows, __doc__)
