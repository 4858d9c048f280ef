"""How tests wait: on a condition, with a generous deadline that is a failure bound only, never a
guess at how long something takes (the suite must hold on an oversubscribed machine)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

DEADLINE_S = 120.0


def wait_for(
    condition: Callable[[], object], what: str, timeout: float = DEADLINE_S, poll_s: float = 0.02
) -> None:
    """Poll `condition` until it is true; fail, saying `what` never happened, after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(poll_s)


async def settle(
    condition: Callable[[], bool], what: str = "the condition", *, timeout: float = DEADLINE_S
) -> None:
    """Let the event loop run (its timers included) until `condition` holds: turn by turn at
    first, then in short naps, so that other threads (a busy machine's) get to run too; fail,
    saying `what` never happened, after `timeout`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    turns = 0
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        turns += 1
        await asyncio.sleep(0 if turns < 1000 else 0.001)
