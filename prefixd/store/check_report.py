"""The report `prefixd verify` prints, offline or from the daemon: the same JSON either way."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prefixd.store.check_process import run_check
from prefixd.store.results import Problem, RepairReport

if TYPE_CHECKING:
    from prefixd.store.store import Store

MAX_LISTED = 1000  # problems listed one by one; the counts by kind cover all of them


def verify_report(
    blocks: int, parts: int, *, problems: Sequence[Problem] = (), fixed: RepairReport | None = None
) -> dict[str, Any]:
    """What a check found, or what a repair (`fixed`) found, did and left, listed the same way."""
    found = fixed.problems if fixed is not None else problems
    report: dict[str, Any] = {
        "blocks": blocks,
        "parts": parts,
        "problems": [str(p) for p in found[:MAX_LISTED]],
        "by_kind": dict(Counter(p.kind for p in found)),
        "count": len(found),
    }
    if fixed is not None:
        report["quarantined"] = fixed.quarantined
        report["fixed"] = fixed.fixed
        report["remaining"] = [str(p) for p in fixed.remaining[:MAX_LISTED]]
    return report


def verify(
    store: Store, *, fix: bool, payloads: bool, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    """Check `store` in a child process (LMDB may abort on a damaged page) and, with `fix`, repair
    what a repair can mend (checking payloads then); damaged pages are left as they are."""
    problems = run_check(store.path, verify_payloads=payloads or fix, progress=progress)
    fixed = None
    if fix and any(p.kind == "pages" for p in problems):  # a repair cannot mend it: left as it is
        fixed = RepairReport(tuple(problems), 0, 0, tuple(problems))
    elif fix:
        fixed = store.repair(problems)
    stats = store.stats()
    return verify_report(stats.blocks, stats.parts, problems=problems, fixed=fixed)
