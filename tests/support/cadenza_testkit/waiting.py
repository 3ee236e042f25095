"""Wait on a condition with a deadline, never for a fixed time: a fixed sleep is either too
short on a slow machine (a flaky test) or longer than needed on a fast one (a slow suite)."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable

# A hang guard, not a duration the test states: conditions hold within milliseconds here.
DEADLINE_S = 60.0
POLL_S = 0.01


async def until(check: Callable[[], bool | Awaitable[bool]], what: str, deadline_s: float = DEADLINE_S) -> None:
    """Return once `check()` (sync or async) is true; fail naming `what` past the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        result = check()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        await asyncio.sleep(POLL_S)


def until_sync(check: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    """until() for code with no event loop of its own."""
    end = time.monotonic() + deadline_s
    while not check():
        if time.monotonic() > end:
            raise AssertionError(f"not within {deadline_s} s: {what}")
        time.sleep(POLL_S)
