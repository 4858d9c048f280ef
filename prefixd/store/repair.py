"""`repair` (`verify --fix`): quarantine in one write transaction the blocks a check condemns, each
with its subtree, and rebuild what derives from the records left."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prefixd.store import quarantine
from prefixd.store.check import check
from prefixd.store.derived import rebuild_derived
from prefixd.store.removal import remove_subtree
from prefixd.store.results import Problem, RepairReport

if TYPE_CHECKING:
    from prefixd.store.context import StoreContext

log = logging.getLogger(__name__)

# Problems that condemn their block (and so everything below it).
BLOCK_PROBLEMS = frozenset({"record", "payload", "part", "orphan", "identity"})


def repair(
    ctx: StoreContext,
    problems: Sequence[Problem] | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> RepairReport:
    if problems is None:
        problems = check(ctx, progress=progress)
    condemned = {
        p.block: p.kind for p in problems if p.kind in BLOCK_PROBLEMS and p.block is not None
    }
    quarantined = 0
    with ctx.writing() as txn:
        for block, kind in condemned.items():
            if txn.get(block, db=ctx.tables.blocks) is None:
                continue  # e.g. a part hung on no block: the rebuild drops it
            quarantined += remove_subtree(ctx, txn, block, reason="quarantined")
            quarantine.note(ctx, txn, block, f"verify: {kind} problem")
        rebuilt = rebuild_derived(txn, ctx.tables, ctx.clock.time_ns())
    if quarantined or rebuilt:
        log.warning(
            "repair quarantined %d block(s) and fixed %d index or counter entries",
            quarantined,
            rebuilt,
        )
    return RepairReport(tuple(problems), quarantined, rebuilt, tuple(check(ctx)))
