"""`repair` (`verify --fix`): quarantine in one write transaction the blocks a check condemns, each
with its subtree, and rebuild what derives from the records left."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prefixd.store import quarantine
from prefixd.store.check import check
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
        p.block: f"verify: {p.kind} problem"
        for p in problems
        if p.kind in BLOCK_PROBLEMS and p.block is not None
    }
    with ctx.writing() as txn:
        quarantined, rebuilt = quarantine.condemn(ctx, txn, condemned)
    if quarantined or rebuilt:
        log.warning(
            "repair quarantined %d block(s) and fixed %d index or counter entries",
            quarantined,
            rebuilt,
        )
    return RepairReport(tuple(problems), quarantined, rebuilt, tuple(check(ctx)))
