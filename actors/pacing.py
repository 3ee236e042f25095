"""Stream pacing for AsyncLLM.generate(pace=True).

A speculative step hands a request several tokens at once (its accepted drafts plus the
target's own token); streamed as they come, a chat client sees bursts and pauses. Pacing
splits such an engine output into one-token outputs and spaces them evenly over the
sequence's recent step interval (an EWMA of the time between its engine outputs), so the
tokens of one step fill the wait for the next. A token is never held past the arrival of
the next engine output (the rest of the step then goes out at once) nor at the finish.
"""

from __future__ import annotations

import asyncio
import time

import msgspec

from cadenza.messages import EngineOutput

# Weight of the newest interval: a few steps of memory, so the cadence follows a batch that
# grows or shrinks within a second or two without copying every single step's jitter.
EWMA_ALPHA = 0.3

# What the engine pump puts on a request's queue: (arrival, output) or the error to raise.
Arrival = tuple[float, EngineOutput]
QueueItem = Arrival | BaseException


def split_output(out: EngineOutput) -> list[EngineOutput]:
    """One output per token, each with its logprobs. The first also carries the step's prompt
    logprobs and drafts verified (so the step counts once), the last its finish."""
    ids = out.new_token_ids
    if len(ids) <= 1:
        return [out]
    accepted = accepted_per_token(out.num_accepted_tokens, len(ids))
    last = len(ids) - 1
    return [
        msgspec.structs.replace(
            out,
            new_token_ids=[token],
            new_logprobs=out.new_logprobs[i : i + 1],
            new_prompt_logprobs=out.new_prompt_logprobs if i == 0 else [],
            finish_reason=out.finish_reason if i == last else None,
            error=out.error if i == last else None,
            stop_reason=out.stop_reason if i == last else None,
            num_draft_tokens=out.num_draft_tokens if i == 0 else 0,
            num_accepted_tokens=accepted[i],
        )
        for i, token in enumerate(ids)
    ]


def accepted_per_token(accepted: int, num_tokens: int) -> list[int]:
    """A step's accepted drafts are its first tokens (the target's own comes last). When a stop
    cut the step short, the remainder goes on the last token, so the pieces sum to the step."""
    counts = [1 if i < accepted else 0 for i in range(num_tokens - 1)]
    return counts + [accepted - sum(counts)]


class StepClock:
    """EWMA of the time between one sequence's engine outputs that bring tokens."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._ewma: dict[str, float] = {}

    def observe(self, request_id: str, at: float) -> float | None:
        """Record an output arriving at `at`; the interval estimate, None until there is one."""
        last, self._last[request_id] = self._last.get(request_id), at
        if last is None:
            return None
        interval, previous = at - last, self._ewma.get(request_id)
        estimate = interval if previous is None else EWMA_ALPHA * interval + (1 - EWMA_ALPHA) * previous
        self._ewma[request_id] = estimate
        return estimate


class Pacer:
    """Reads one request's queue and says when each (possibly split) output is due.

    Disabled, it hands each engine output over whole and at once."""

    def __init__(self, queue: asyncio.Queue[QueueItem], enabled: bool) -> None:
        self.queue = queue
        self.enabled = enabled
        self.clock = StepClock()
        self._carry: QueueItem | None = None  # the next item, taken off the queue while waiting

    async def next(self) -> QueueItem:
        item, self._carry = self._carry, None
        return item if item is not None else await self.queue.get()

    def schedule(self, at: float, out: EngineOutput) -> list[tuple[float | None, EngineOutput]]:
        """The output's pieces, each with the monotonic time it is due (None: now)."""
        if not self.enabled or not out.new_token_ids:
            return [(None, out)]
        interval = self.clock.observe(out.request_id, at)
        pieces = split_output(out)
        if interval is None or out.finish_reason is not None:
            return [(None, piece) for piece in pieces]  # nothing to pace by yet, or finishing: flush
        start, gap = time.monotonic(), interval / len(pieces)
        return [(None if k == 0 else start + k * gap, piece) for k, piece in enumerate(pieces)]

    async def wait_until(self, due: float | None) -> None:
        """Sleep until `due`, unless the next engine output comes first (then flush: no wait)."""
        if due is None or self._carry is not None:
            return
        timeout = due - time.monotonic()
        if timeout > 0:
            self._carry = await next_within(self.queue, timeout)


async def next_within(queue: asyncio.Queue[QueueItem], timeout: float) -> QueueItem | None:
    """The next queue item if one comes within `timeout` seconds, else None (nothing is lost:
    a cancelled Queue.get leaves its item in the queue)."""
    if not queue.empty():
        return queue.get_nowait()
    getter = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait({getter}, timeout=timeout)
    finally:
        if not getter.done():
            getter.cancel()
    return getter.result() if getter.done() and not getter.cancelled() else None
