"""Per-step timelines: where each engine step's time goes, from schedule() to the caller.

The engine and the driver stamp every step (messages.StepTiming); the client adds when the
step's batch arrived and when each request's delta was handed to its caller. A
TimelineRecorder (off unless a benchmark or test turns it on) keeps them; `stages` splits a
step into consecutive stages, so the stages of one step add up to the time from its
schedule() to its caller, and `step_period` adds the gap to the next step's schedule().
"""

from __future__ import annotations

import statistics
from collections import OrderedDict

from cadenza.messages import StepTiming

# Stages in the order they happen, each the time between two stamps (cadenza bench actors).
STAGES = (
    ("schedule", "scheduled", "dispatched"),  # the scheduler picks the step
    ("executor_call", "dispatched", "started"),  # the step reaches the driver (a thread or an actor call)
    ("forward", "started", "forwarded"),  # inputs prepared, the model's layers
    ("sample", "forwarded", "sampled"),  # LM head, sampling, logprobs, drafts
    ("output_to_engine", "sampled", "returned"),  # the output back in the engine's loop
    ("engine_update", "returned", "published"),  # scheduler.update: tokens, stops, KV bookkeeping
    ("engine_to_client", "published", "received"),  # the output batch to AsyncLLM's process
    ("client_to_caller", "received", "delivered"),  # routed, detokenized, yielded by generate()
)

# Steps kept by a recorder; older ones are dropped first.
MAX_RECORDED_STEPS = 4096


class TimelineRecorder:
    """What a client saw of each step: the engine's stamps, and per request when it delivered."""

    def __init__(self, limit: int = MAX_RECORDED_STEPS) -> None:
        self.limit = limit
        self.steps: OrderedDict[int, StepTiming] = OrderedDict()
        self.delivered: dict[int, dict[str, float]] = {}  # step -> request id -> when

    def on_batch(self, timings: list[StepTiming], received: float) -> None:
        for timing in timings:
            timing.received = received
            self.steps[timing.step] = timing
        while len(self.steps) > self.limit:
            step, _ = self.steps.popitem(last=False)
            self.delivered.pop(step, None)

    def on_delivery(self, request_id: str, step: int, at: float) -> None:
        self.delivered.setdefault(step, {}).setdefault(request_id, at)

    def stages(self, request_id: str) -> list[dict[str, float]]:
        """Seconds per stage for each step that delivered to `request_id`, in step order."""
        rows = []
        for step, timing in self.steps.items():
            at = self.delivered.get(step, {}).get(request_id)
            if at is not None:
                rows.append(stages(timing, at))
        return rows

    def periods(self) -> list[float]:
        """Seconds from each recorded step's schedule() to the next one's."""
        ordered = list(self.steps.values())
        return [step_period(a, b) for a, b in zip(ordered, ordered[1:])]


def stages(timing: StepTiming, delivered: float) -> dict[str, float]:
    """The step's consecutive stages (seconds); they add up to `delivered - timing.scheduled`."""
    stamps = {field: getattr(timing, field) for field in StepTiming.__struct_fields__} | {"delivered": delivered}
    return {name: stamps[end] - stamps[begin] for name, begin, end in STAGES}


def step_period(timing: StepTiming, next_timing: StepTiming) -> float:
    return next_timing.scheduled - timing.scheduled


def engine_gap(timing: StepTiming, next_timing: StepTiming) -> float:
    """Between publishing one step and scheduling the next: the engine loop's own time
    (answering the client's call, admitting requests) that no stage covers."""
    return next_timing.scheduled - timing.published


def median_stages(rows: list[dict[str, float]]) -> dict[str, float]:
    """The median of each stage over rows, in milliseconds."""
    if not rows:
        return {}
    return {name: 1e3 * statistics.median(row[name] for row in rows) for name, *_ in STAGES}
