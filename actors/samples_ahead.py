"""Scheduling ahead (async scheduling, one runner that is the whole model): the scheduler plans
step N + 1 before it has step N's tokens, so the runner keeps its own samples. A step's samples
stay on the device (DeviceSamples) and feed the next step from there; they are settled, read
on the host and appended, only once that next step's forward pass is launched, so on a GPU the
wait overlaps it. The runner stops computing a request its own token ended, or whose step
failed, until the scheduler drops it."""

from __future__ import annotations

from cadenza.actors.device_samples import DeviceSamples, PendingOutput
from cadenza.actors.input_batch import RunnerRequest
from cadenza.actors.request import ends_on_token
from cadenza.messages import ModelRunnerOutput


class SamplesAhead:
    """The runner's record of what it sampled ahead of the scheduler, over the runner's requests."""

    def __init__(self, requests: dict[str, RunnerRequest], eos_token_ids: tuple[int, ...]) -> None:
        self.requests = requests  # the runner's own dict, shared: never rebound
        self.eos_token_ids = eos_token_ids
        self.stopped: set[str] = set()  # ended here, awaiting the scheduler's drop
        self.previous: DeviceSamples | None = None  # the last step's, not yet settled
        self.samples: DeviceSamples | None = None  # this step's, once sampled

    def computable(self, scheduled: dict[str, int]) -> dict[str, int]:
        """The scheduled requests this runner can compute. Not those it stopped, nor one planned
        past its known tokens: a step planned before it never reached this runner (it failed
        on the way), so the tokens it would have sampled do not exist."""
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if req.num_computed_tokens + n > req.num_known:
                self.stopped.add(rid)
        return {rid: n for rid, n in scheduled.items() if rid not in self.stopped}

    def grammar_waits(self, scheduled: dict[str, int]) -> bool:
        """Whether a grammar request follows a pending token: its mask needs that token settled."""
        return any(
            (req := self.requests[rid]).pending and req.params.structured_outputs is not None for rid in scheduled
        )

    def settle(self) -> None:
        """The previous step's samples to the host, appended where still pending."""
        previous, self.previous = self.previous, None
        if previous is None:
            return
        for rid, token in zip(previous.req_ids, previous.values()[0], strict=True):
            req = self.requests.get(rid)
            if req is not None and req.pending:  # not dropped (or its id reused) meanwhile
                req.pending = False
                self._append(req, token)

    def finish(self, out: ModelRunnerOutput) -> PendingOutput:
        """The step's output, its samples kept: those on the host appended now, those still on
        the device marked pending, fed to the next step from there."""
        self.stopped.update(out.failed)
        for rid, tokens in out.sampled.items():  # sampled on the host (a batch retried alone)
            self._append(self.requests[rid], tokens[-1])
        samples, self.samples = self.samples, None
        if samples is not None:
            for rid in samples.req_ids:
                # A request its settled token just ended computed once more; that token is
                # dropped here and by the scheduler, which has ended it.
                self.requests[rid].pending = rid not in self.stopped
            self.previous = samples
        return PendingOutput(out, samples)

    def _append(self, req: RunnerRequest, token: int) -> None:
        req.token_ids.append(token)
        if ends_on_token(token, len(req.token_ids) - req.num_prompt_tokens, req.params, self.eos_token_ids):
            self.stopped.add(req.req_id)
