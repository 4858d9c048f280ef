"""The report `prefixd verify` prints, offline or from the daemon: the same JSON either way
(the check itself is prefixd.store.check; run in a child, prefixd.store.check_process)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from prefixd.store.results import Problem, RepairReport

MAX_LISTED = 1000  # problems listed one by one; the counts by kind cover all of them


def verify_report(
    blocks: int,
    parts: int,
    *,
    problems: Sequence[Problem] = (),
    fixed: RepairReport | None = None,
) -> dict[str, Any]:
    """`problems` found by a check, or what a repair (`fixed`) found, did and left: the
    problems are listed the same way in both (a script reads one shape)."""
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
