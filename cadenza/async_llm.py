"""AsyncLLM: the streaming client of the actor runtime.

    llm = AsyncLLM("SmolLM2-135M-Instruct", tensor_parallel_size=2)
    async for delta in llm.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.outputs[0].text, end="")

It tokenizes and detokenizes here, in the caller's process; the EngineActor schedules and
its worker actors compute. One background task per event loop pulls output batches from the
engine and routes each delta to its request's queue. Leaving the `async for` early or
cancelling the task aborts the request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import ray

from cadenza.actors.engine_actor import ActorStats, EngineActor, OutputBatch
from cadenza.config import EngineConfig
from cadenza.local_ray import ensure_ray
from cadenza.messages import EngineOutput
from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model
from cadenza.models.shard import stage_layers
from cadenza.models.tokenizer import Tokenizer
from cadenza.models.tp import check_tp
from cadenza.output_processor import SequenceState
from cadenza.outputs import CompletionOutput, RequestOutput
from cadenza.pacing import Pacer, QueueItem
from cadenza.prompts import PendingRequest, Prompt, fan_out, require_tokenizer, tokenize
from cadenza.sampling_params import SamplingParams

_batch_decoder = msgspec.msgpack.Decoder(OutputBatch)
_stats_decoder = msgspec.msgpack.Decoder(ActorStats)
_RemoteEngine = ray.remote(EngineActor)
SHUTDOWN_TIMEOUT_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine actor is gone; create a new AsyncLLM."""


class RequestFailedError(RuntimeError):
    """The engine ended this request with an error (e.g. a worker died mid-step)."""


class AsyncLLM:
    """Engine arguments are EngineConfig's (including tensor_parallel_size,
    pipeline_parallel_size, num_cpus_per_worker, num_gpus_per_worker)."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "float32", seed: int = 0, **engine_args: Any) -> None:
        self.config = EngineConfig(model=model, dtype=dtype, seed=seed, **engine_args)
        path, self.model_config = read_model(model)
        check_tp(self.model_config, self.config.tensor_parallel_size)
        stage_layers(self.model_config.num_layers, self.config.pipeline_parallel_size, 0)
        self.tokenizer: Tokenizer | None = load_tokenizer(path, self.model_config)
        ensure_ray(self.config.world_size)
        self.engine = _RemoteEngine.options(num_cpus=0).remote(msgspec.msgpack.encode(self.config))
        try:
            self.max_model_len: int = ray.get(self.engine.start.remote())
        except ray.exceptions.RayError as e:
            ray.kill(self.engine)
            raise RuntimeError(f"the engine failed to start: {e}") from e
        self.request_limits = self.config.request_limits(self.model_config.vocab_size, self.max_model_len)
        self._queues: dict[str, asyncio.Queue[QueueItem]] = {}
        self._families: dict[str, list[str]] = {}  # request id -> its engine sequences (n > 1)
        self._pump: asyncio.Task[None] | None = None
        self._dead: str | None = None
        self._ids = itertools.count()

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
    ) -> AsyncIterator[RequestOutput]:
        """Deltas of one request: each output holds only what is new since the last one.

        pace: when a step brings several tokens (speculative decoding), yield them one per
        delta, spread over the request's recent step interval instead of in one burst.
        cache_salt: mixed into every KV block hash, so requests with another salt (another
        tenant) never share this request's cached prefix."""
        self._check_alive()
        params = sampling_params or SamplingParams()
        text, ids = tokenize(self.tokenizer, prompt)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        pending, requests = fan_out(rid, text, ids, params, priority, self.tokenizer, cache_salt)
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
                        yield delta
        finally:
            self._families.pop(rid, None)
            for child in pending.seqs:
                self._queues.pop(child, None)
            unfinished = [child for child, seq in pending.seqs.items() if not seq.finished]
            if unfinished and not self._dead:
                self.engine.abort.remote(unfinished)  # fire and forget: this may run mid-cancel

    async def _submit(self, requests: list[Any]) -> None:
        for req in requests:
            try:
                error = await self.engine.add_request.remote(msgspec.msgpack.encode(req))
            except ray.exceptions.RayActorError as e:
                raise self._mark_dead(e) from e
            if error is not None:
                raise ValueError(error)

    def _apply(self, out: EngineOutput, pending: PendingRequest) -> RequestOutput | None:
        """Run one engine output through its sequence; the client's delta, if any is due."""
        seq = pending.seqs[out.request_id]
        if seq.finished:
            return None  # a stop string ended it; what the engine sent before the abort is moot
        seen_tokens, seen_logprobs = len(seq.token_ids), len(seq.logprobs or [])
        seen_accepted = seq.metrics.num_accepted_tokens
        if seq.process(out):
            self.engine.abort.remote([out.request_id])  # a stop string ended it here
        if out.finish_reason == "error":
            raise RequestFailedError(f"request {out.request_id}: {out.error}")
        text = seq.visible_delta()
        new_tokens = seq.token_ids[seen_tokens:]
        if not (text or new_tokens or seq.finished):
            return None
        new_logprobs = seq.logprobs[seen_logprobs:] if seq.logprobs is not None else None
        accepted = seq.metrics.num_accepted_tokens - seen_accepted
        return _delta(pending, seq, text, new_tokens, new_logprobs, accepted)

    async def abort(self, request_id: str) -> None:
        """Abort exactly this request (all n of its sequences), never another whose id merely
        starts the same way."""
        await self.engine.abort.remote(self._families.get(request_id, [request_id]))

    async def stats(self) -> ActorStats:
        self._check_alive()
        try:
            return _stats_decoder.decode(await self.engine.stats.remote())
        except ray.exceptions.RayActorError as e:
            raise self._mark_dead(e) from e

    async def check_health(self) -> None:
        """Raises when the engine cannot serve."""
        self._check_alive()
        try:
            problem = await self.engine.health.remote()
        except ray.exceptions.RayActorError as e:
            raise self._mark_dead(e) from e
        if problem:
            raise EngineDeadError(problem)

    def shutdown(self) -> None:
        """Release the workers, their placement group and the engine actor."""
        if self._pump is not None:
            self._pump.cancel()
        try:
            ray.get(self.engine.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        except ray.exceptions.RayError:
            pass  # already dead: Ray reclaims what it owned
        ray.kill(self.engine)
        self._dead = "the engine was shut down"

    def _check_alive(self) -> None:
        if self._dead:
            raise EngineDeadError(self._dead)

    def _mark_dead(self, error: BaseException) -> EngineDeadError:
        self._dead = f"the engine actor died: {type(error).__name__}"
        dead = EngineDeadError(self._dead)
        for queue in self._queues.values():
            queue.put_nowait(dead)
        return dead

    def _ensure_pump(self) -> None:
        loop = asyncio.get_running_loop()
        if self._pump is None or self._pump.done() or self._pump.get_loop() is not loop:
            self._pump = loop.create_task(self._pull_outputs())

    async def _pull_outputs(self) -> None:
        ack = 0
        while True:
            try:
                batch = _batch_decoder.decode(await self.engine.get_outputs.remote(ack))
            except ray.exceptions.RayActorError as e:
                self._mark_dead(e)
                return
            ack, at = batch.last, time.monotonic()  # arrival times pace streams (pacing.py)
            for out in batch.outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait((at, out))


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
    prompt_logprobs = seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None
    return RequestOutput(
        pending.request_id,
        pending.prompt,
        pending.prompt_ids,
        prompt_logprobs,
        [completion],
        pending.finished,
        seq.num_cached_tokens,
        [seq.metrics],
    )
