"""The per-step timeline (cadenza.actors.timeline) through both executors: every stage is a
non-negative span between stamps taken in order across processes, the stages of a step add
up to its time from schedule() to the caller, and with the gap between steps to the step."""

from __future__ import annotations

import asyncio
import math
import os

import pytest

from cadenza import LLM, AsyncLLM, SamplingParams
from cadenza.actors.timeline import STAGES, TimelineRecorder, engine_gap, stages, step_period
from cadenza.messages import StepTiming

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPT = [5, 17, 33, 2, 90, 41]


def _stamped(step: int, start: float) -> StepTiming:
    return StepTiming(step, 1, 1, *(start + k for k in range(7)), received=start + 7)


def test_stages_are_consecutive_and_add_up() -> None:
    timing = _stamped(1, 10.0)
    parts = stages(timing, delivered=17.5)
    assert list(parts) == [name for name, *_ in STAGES]
    assert all(v == 1.0 for name, v in parts.items() if name != "client_to_caller")
    assert parts["client_to_caller"] == 0.5
    assert math.isclose(sum(parts.values()), 17.5 - timing.scheduled)
    later = _stamped(2, 30.0)
    engine_side = sum(parts[name] for name, *_ in STAGES[:6])
    assert math.isclose(engine_side + engine_gap(timing, later), step_period(timing, later))


def test_recorder_forgets_the_oldest_steps() -> None:
    recorder = TimelineRecorder(limit=3)
    recorder.on_batch([_stamped(s, 100.0 * s) for s in range(1, 6)], received=1e4)
    for s in range(1, 6):
        recorder.on_delivery("r", s, 1e4 + s)
    assert list(recorder.steps) == [3, 4, 5]
    assert len(recorder.stages("r")) == 3 and len(recorder.periods()) == 2


@pytest.mark.parametrize(("executor", "ahead"), [("local", False), ("ray", False), ("local", True), ("ray", True)])
def test_timeline_of_a_stream_adds_up(ray_cluster, tiny_model, executor: str, ahead: bool) -> None:
    """Scheduling ahead, step N + 1 is scheduled before step N is published: the engine gap
    is negative by the overlap and executor_call holds the wait behind step N; the stages
    still add up."""
    path = str(tiny_model("llama_gqa_tied")[0])
    (expected,) = LLM(path, num_blocks=64).generate([{"prompt_token_ids": PROMPT}], GREEDY)
    llm = AsyncLLM(path, num_blocks=64, executor=executor, async_scheduling=ahead)
    llm.recorder = TimelineRecorder()

    async def run() -> tuple[list[int], str]:
        tokens, rid = [], None
        async for delta in llm.generate({"prompt_token_ids": PROMPT}, GREEDY):
            tokens += delta.outputs[0].token_ids
            rid = delta.request_id
        stats = await llm.stats()
        # The model's processes run at the serving process's priority, not Ray's nice 15.
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == 0 for pid in [stats.engine_pid, *stats.worker_pids])
        return tokens, rid, stats.executor

    try:
        tokens, rid, used = asyncio.run(run())
    finally:
        llm.shutdown()
    assert tokens == expected.outputs[0].token_ids and used == executor
    rows = llm.recorder.stages(rid)
    assert len(rows) == GREEDY.max_tokens  # one step per token, each delivered
    for row in rows:
        assert all(v >= 0 for v in row.values()), row  # stamps in order, across processes
    steps = list(llm.recorder.steps.values())
    gaps = [engine_gap(timing, later) for timing, later in zip(steps, steps[1:])]
    assert not ahead or min(gaps) < 0  # by construction: N + 1 is planned before N is published
    for timing, later in zip(steps, steps[1:]):
        parts = stages(timing, later.scheduled)  # any end: the engine-side stages are what count
        engine_side = sum(parts[name] for name, *_ in STAGES[:6])
        assert ahead or engine_gap(timing, later) >= 0
        assert math.isclose(engine_side + engine_gap(timing, later), step_period(timing, later), abs_tol=1e-9)
