"""Stream pacing (cadenza/pacing.py) on its own: splitting a step, the step clock, and the
rule that a paced token never waits past the next engine output."""

from __future__ import annotations

import asyncio
import time

from cadenza.actors.pacing import Pacer, StepClock, accepted_per_token, split_output
from cadenza.messages import EngineOutput, TokenLogprobs


def _step(tokens: list[int], accepted: int, finish: str | None = None) -> EngineOutput:
    return EngineOutput(
        request_id="r",
        new_token_ids=tokens,
        new_logprobs=[TokenLogprobs([t], [-0.5], 1) for t in tokens],
        finish_reason=finish,
        stop_reason=tokens[-1] if finish else None,
        num_draft_tokens=4,
        num_accepted_tokens=accepted,
    )


def test_split_gives_one_token_each_and_keeps_the_step_counts() -> None:
    pieces = split_output(_step([5, 6, 7], accepted=2, finish="stop"))
    assert [p.new_token_ids for p in pieces] == [[5], [6], [7]]
    assert [p.new_logprobs[0].token_ids for p in pieces] == [[5], [6], [7]]
    assert [p.finish_reason for p in pieces] == [None, None, "stop"]
    assert [p.stop_reason for p in pieces] == [None, None, 7]
    assert [p.num_draft_tokens for p in pieces] == [4, 0, 0]  # the step counts once
    assert [p.num_accepted_tokens for p in pieces] == [1, 1, 0]  # drafts first, the target's token last
    one = _step([9], accepted=0)
    assert split_output(one) == [one]


def test_a_step_cut_short_by_a_stop_keeps_its_accepted_total() -> None:
    assert accepted_per_token(3, 2) == [1, 2]
    assert accepted_per_token(0, 3) == [0, 0, 0]


def test_step_clock_is_an_ewma_of_intervals_per_sequence() -> None:
    clock = StepClock()
    assert clock.observe("a", 10.0) is None
    assert abs(clock.observe("a", 10.2) - 0.2) < 1e-9
    second = clock.observe("a", 10.6)  # interval 0.4 pulls the estimate up, not all the way
    assert 0.2 < second < 0.4
    assert clock.observe("b", 10.6) is None  # sequences keep their own clocks


def test_paced_pieces_are_due_evenly_over_the_step_interval() -> None:
    pacer = Pacer(asyncio.Queue(), enabled=True)
    assert [d for d, _ in pacer.schedule(10.0, _step([1], 0))] == [None]  # no interval yet
    due = [d for d, _ in pacer.schedule(10.4, _step([1, 2, 3, 4], 3))]  # interval 0.4 s, 4 pieces
    assert due[0] is None  # the first token goes out at once
    assert all(abs((b - a) - 0.1) < 1e-9 for a, b in zip(due[1:], due[2:]))


def test_a_paced_wait_ends_when_the_next_output_arrives() -> None:
    """Tokens are never held past the next engine output: a wait due in an hour ends at once
    when the next output comes, and that output is kept for the reader."""

    async def run() -> list[int]:
        queue: asyncio.Queue = asyncio.Queue()
        pacer = Pacer(queue, enabled=True)
        asyncio.get_running_loop().call_soon(queue.put_nowait, (0.0, _step([9], 0)))
        await pacer.wait_until(time.monotonic() + 3600)
        return (await pacer.next())[1].new_token_ids

    # The bound only keeps a broken pacer from hanging the suite.
    assert asyncio.run(asyncio.wait_for(run(), timeout=60)) == [9]


def test_disabled_or_finishing_outputs_are_not_delayed() -> None:
    pacer = Pacer(asyncio.Queue(), enabled=False)
    out = _step([1, 2, 3], 2)
    assert pacer.schedule(0.0, out) == [(None, out)]
    pacer = Pacer(asyncio.Queue(), enabled=True)
    pacer.schedule(0.0, _step([1], 0))
    assert [d for d, _ in pacer.schedule(0.5, _step([1, 2, 3], 2, finish="length"))] == [None, None, None]
