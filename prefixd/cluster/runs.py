"""How a read-through cuts the blocks it asks for into batches, and what of a hybrid batch can
be installed: the pages and checkpoints it closes (prefixd.cluster.bridge)."""

from __future__ import annotations

import math

from prefixd.cluster.blocks import RemoteBlock
from prefixd.schema.identity import Identity
from prefixd.schema.state import PAGED, StateSpec


def page_span(identity: Identity) -> int:
    """Blocks after which every paged group closes a page at once: batches end on its multiples, so
    each can be installed alone."""
    return math.lcm(1, *(g.page_blocks for g in identity.state or () if g.kind == PAGED))


def batches(start: int, end: int, per_batch: int, align: int) -> list[tuple[int, int]]:
    """Blocks [start, end) in runs of about `per_batch`, each ending on a multiple of `align` (but
    the last)."""
    runs = []
    while start < end:
        stop = (start + per_batch) // align * align
        if stop <= start:
            stop = (start // align + 1) * align
        runs.append((start, min(stop, end)))
        start = runs[-1][1]
    return runs


def closed_run(spec: StateSpec, block_tokens: int, first: int, blocks: list[RemoteBlock]) -> int:
    """How many of `blocks` can be installed: the longest run ending where every paged group closes
    a page, carrying every page and checkpoint its group promises (as `put_state` asks)."""
    closed = 0
    for index, block in enumerate(blocks, first):
        boundary = (index + 1) * block_tokens
        for gi, group in enumerate(spec):
            if group.kind == PAGED:
                needed = (index + 1) % group.page_blocks == 0  # a page hangs on its last block
            elif group.policy == "full":
                needed = True
            else:
                needed = group.policy == "periodic" and boundary % group.period_tokens == 0
            if needed and gi not in block.parts:
                return closed
        if all((index + 1) % g.page_blocks == 0 for g in spec if g.kind == PAGED):
            closed = index + 1 - first
    return closed


def state_of(
    spec: StateSpec, block_tokens: int, first: int, blocks: list[RemoteBlock]
) -> tuple[dict[str, list[memoryview]], dict[str, dict[int, memoryview]]]:
    """The pages and checkpoints of `blocks`, as `Store.put_state` takes them."""
    paged: dict[str, list[memoryview]] = {g.name: [] for g in spec if g.kind == PAGED}
    checkpoints: dict[str, dict[int, memoryview]] = {}
    for index, block in enumerate(blocks, first):
        for gi, part in sorted(block.parts.items()):
            group = spec[gi]
            if group.kind == PAGED:
                paged[group.name].append(part)
            else:
                checkpoints.setdefault(group.name, {})[(index + 1) * block_tokens] = part
    return paged, checkpoints
