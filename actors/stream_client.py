"""StreamingClient: the EngineClient machinery every engine transport shares.

An engine takes EngineRequests and publishes EngineOutputs (per-request token deltas). This
class turns them into a request's stream of RequestOutput deltas: tokenizing, fanning n > 1
out, one queue per engine sequence fed by one background pump per event loop, pacing,
detokenizing and stop strings, and aborting whatever the caller stopped reading. Subclasses
say how requests reach the engine and how its outputs come back: AsyncLLM over Ray actors,
InProcessClient over an EngineCore stepped in this process.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Iterable

from cadenza.actors.output_processor import SequenceState
from cadenza.actors.pacing import Pacer, QueueItem
from cadenza.actors.prompts import PendingRequest, fan_out, require_tokenizer, tokenize
from cadenza.actors.timeline import TimelineRecorder
from cadenza.config import EngineConfig
from cadenza.engine_client import Prompt
from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.messages import EngineOutput, EngineRequest
from cadenza.models.tokenizer import Tokenizer
from cadenza.outputs import CompletionOutput, RequestOutput
from cadenza.request_limits import RequestLimits
from cadenza.sampling_params import SamplingParams


class StreamingClient:
    """Subclasses set config, tokenizer, max_model_len and request_limits, call
    `super().__init__()`, and implement _submit, _abort_soon, _abort and _pull_outputs."""

    config: EngineConfig
    tokenizer: Tokenizer | None
    max_model_len: int
    request_limits: RequestLimits

    def __init__(self) -> None:
        self._queues: dict[str, asyncio.Queue[QueueItem]] = {}
        self._families: dict[str, list[str]] = {}  # request id -> its engine sequences (n > 1)
        self._pump: asyncio.Task[None] | None = None
        self._dead: str | None = None
        self._ids = itertools.count()
        # Set by benchmarks and tests to keep each step's timeline (cadenza.actors.timeline).
        self.recorder: TimelineRecorder | None = None

    @property
    def dead(self) -> bool:
        """The engine is gone for good (its restarts spent, or shut down)."""
        return self._dead is not None

    @property
    def speculative(self) -> bool:
        return self.config.speculative_config is not None

    def get_tokenizer(self) -> Tokenizer:
        return require_tokenizer(self.tokenizer)

    async def generate(
        self,
        prompt: Prompt,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        pace: bool = False,
        cache_salt: str | None = None,
        session_id: str | None = None,
        resume_from: list[int] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request: each output holds only what is new since the last one.

        pace: when a step brings several tokens (speculative decoding), yield them one per
        delta, spread over the request's recent step interval instead of in one burst.
        cache_salt: mixed into every KV block hash, so requests with another salt (another
        tenant) never share this request's cached prefix.
        session_id: the conversation this is a turn of; its prefix stays pinned in the KV
        cache between turns (EngineConfig.session_pin_ttl_s).
        resume_from: this request's outputs so far, sampled elsewhere (disaggregation's prefill
        engine): the engine resumes after them and the stream yields only what follows."""
        self._check_alive()
        params = sampling_params or SamplingParams()
        if params.structured_outputs is not None:  # a grammar that cannot compile: refused here
            # In a thread: a large schema compiles for a while. The gateway checked it already
            # (grammar_budget.py), and the verdict is cached in this process by its digest.
            await asyncio.to_thread(params.structured_outputs.check)
        text, ids = tokenize(self.tokenizer, prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        pending, requests = fan_out(
            rid, text, ids, params, priority, self.tokenizer, cache_salt, session_id, resume_from
        )
        if rid in self._families or any(r.request_id in self._queues for r in requests):
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue[QueueItem] = asyncio.Queue()
        self._queues.update(dict.fromkeys(pending.seqs, queue))
        self._families[rid] = list(pending.seqs)
        self._ensure_pump()
        pacer = Pacer(queue, enabled=pace)
        try:
            await self._submit(requests)
            while not pending.finished:
                item = await pacer.next()
                if isinstance(item, BaseException):
                    raise item
                for due, out in pacer.schedule(*item):
                    await pacer.wait_until(due)
                    delta = self._apply(out, pending)
                    if delta is not None:
                        if self.recorder is not None:
                            self.recorder.on_delivery(out.request_id, out.step, time.monotonic())
                        yield delta
        finally:
            self._families.pop(rid, None)
            for child in pending.seqs:
                self._queues.pop(child, None)
            unfinished = [child for child, seq in pending.seqs.items() if not seq.finished]
            if unfinished and not self._dead:
                self._abort_soon(unfinished)  # this may run mid-cancel: never await here

    async def abort(self, request_id: str) -> None:
        """Abort exactly this request (all n of its sequences), never another whose id merely
        starts the same way."""
        await self._abort(self._families.get(request_id, [request_id]))

    def _apply(self, out: EngineOutput, pending: PendingRequest) -> RequestOutput | None:
        """Run one engine output through its sequence; the client's delta, if any is due."""
        seq = pending.seqs[out.request_id]
        if seq.finished:
            return None  # a stop string ended it; what the engine sent before the abort is moot
        seen_tokens, seen_logprobs = len(seq.token_ids), len(seq.logprobs or [])
        seen_accepted = seq.metrics.num_accepted_tokens
        if seq.process(out):
            self._abort_soon([out.request_id])  # a stop string ended it here
        if out.finish_reason == "error":
            raise RequestFailedError(f"request {out.request_id}: {out.error}")
        text = seq.visible_delta()
        new_tokens = seq.token_ids[seen_tokens:]
        if not (text or new_tokens or seq.finished):
            return None
        new_logprobs = seq.logprobs[seen_logprobs:] if seq.logprobs is not None else None
        accepted = seq.metrics.num_accepted_tokens - seen_accepted
        return _delta(pending, seq, text, new_tokens, new_logprobs, accepted)

    def _route(self, arrival: float, outputs: Iterable[EngineOutput]) -> None:
        """Hand each output to its request's queue; `arrival` (monotonic) paces streams."""
        for out in outputs:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait((arrival, out))

    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)

    def _mark_dead(self, reason: str) -> EngineDeadError:
        """From now on every call fails with `reason`; so does every stream in flight."""
        self._dead = reason
        dead = EngineDeadError(reason)
        for queue in self._queues.values():
            queue.put_nowait(dead)
        return dead

    def _ensure_pump(self) -> None:
        loop = asyncio.get_running_loop()
        if self._pump is None or self._pump.done() or self._pump.get_loop() is not loop:
            self._pump = loop.create_task(self._pull_outputs())

    def _stop_pump(self) -> None:
        if self._pump is not None:
            self._pump.cancel()

    async def _submit(self, requests: list[EngineRequest]) -> None:
        """Queue the requests in the engine; ValueError with the engine's reason if refused."""
        raise NotImplementedError

    def _abort_soon(self, request_ids: list[str]) -> None:
        """Abort without waiting (called from finally blocks and the output path)."""
        raise NotImplementedError

    async def _abort(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    async def _pull_outputs(self) -> None:
        """Runs until cancelled: the engine's outputs, handed to _route as they come."""
        raise NotImplementedError


def _delta(
    pending: PendingRequest,
    seq: SequenceState,
    text: str,
    token_ids: list[int],
    logprobs: list | None,
    num_accepted_tokens: int,
) -> RequestOutput:
    completion = CompletionOutput(
        seq.index,
        text,
        token_ids,
        seq.cumulative_logprob,
        logprobs,
        seq.finish_reason,
        seq.stop_reason,
        num_accepted_tokens,
    )
    return pending.request_output([seq], [completion])
