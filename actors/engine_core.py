"""EngineCore: the scheduler and the KV block pool, stepped through an Executor.

The one step loop of every engine: step_async() plans a step (Scheduler.schedule), starts it
on the executor (actors/executor_base.py) and applies a finished step's output
(Scheduler.update), keeping up to pipeline_depth steps in flight: PIPELINE_DEPTH with async
scheduling (EngineConfig.async_scheduling), so step N + 1 is planned and computing while step
N's outputs are applied; one at a time otherwise (vLLM v1's EngineCore.step with its batch
queue). Its owners add transport, recovery and stats: the engine actor (outputs to a client
over Ray), InProcessClient (outputs to its streams on the same event loop) and LLM, which
calls step() and blocks.

Failures: a step that raised in the model fails its own requests (StepError); an engine error
while scheduling or applying an output fails the requests it concerns, and raises EngineBroken
when the scheduler's invariants then fail; a WorkerFailure goes to the owner, who rebuilds the
workers (cancel_in_flight, reset_after_worker_loss). No output is lost on the way: whichever
verb hands outputs over next hands over first those made before a verb raised."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import deque
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import msgspec

from cadenza.actors.block_pool import BlockPool
from cadenza.actors.executor_base import Executor, StepCall
from cadenza.actors.inprocess_executor import InProcessExecutor
from cadenza.actors.kv_cache_manager import KVCacheManager
from cadenza.actors.model_runner import ModelRunner
from cadenza.actors.request import Request
from cadenza.actors.runner_setup import build_runner, kv_pool_blocks
from cadenza.actors.scheduler import Scheduler
from cadenza.actors.step_errors import StepError
from cadenza.config import EngineConfig
from cadenza.messages import EngineOutput, EngineRequest, ModelRunnerOutput, SchedulerOutput, StepTiming
from cadenza.models.config import ModelConfig
from cadenza.models.loader import LoadedModel, load_model, planned_weights_label
from cadenza.request_limits import check_request, max_tokens_to_fill
from cadenza.stats import EngineStats, ServingStats

log = logging.getLogger(__name__)
T = TypeVar("T")

# Steps in flight at once when scheduling ahead: one computing, the next queued behind it.
# A deeper queue would only plan further on placeholders; the model is never kept waiting at 2.
PIPELINE_DEPTH = 2


class EngineBroken(RuntimeError):
    """The scheduler failed its invariants after an engine error: nothing it holds can be
    trusted, so the owner stops serving (the engine actor) or fails every request."""


class InFlight(NamedTuple):
    """A started step: its plan, the executor's call, and when it was scheduled and dispatched."""

    so: SchedulerOutput
    call: StepCall
    scheduled: float
    dispatched: float


class StepResult(NamedTuple):
    """What one step hands its owner: the outputs to publish, and the timeline of the model
    step that finished (None when none did: bookkeeping alone, or the step failed)."""

    outputs: list[EngineOutput]
    timing: StepTiming | None


def model_thread() -> ThreadPoolExecutor:
    """A thread for all of a process's model work, its load and its steps. With libgomp each
    thread that runs torch ops keeps an OpenMP team of its own, and once the teams' threads
    outnumber the cores none of them spins between parallel regions: each region then pays a
    futex wake (SmolLM2's CPU decode ran 1.7x slower with a second team alive)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadenza-model")


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype_size: int) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype_size


def droppable_window(config: EngineConfig, cfg: ModelConfig) -> int | None:
    """The window behind which KV blocks go back to the pool: where every layer slides, and
    no draft model reads the same block tables over the whole context."""
    spec = config.speculative_config
    every_layer = cfg.sliding_window is not None and len(cfg.sliding_layers) == cfg.num_layers
    return cfg.sliding_window if every_layer and (spec is None or spec.method != "draft_model") else None


def num_kv_blocks(config: EngineConfig, cfg: ModelConfig, max_model_len: int) -> int:
    """Blocks in the pool: num_blocks when given; else as many as max_num_seqs requests of
    max_model_len tokens can use at once (each rounded up to whole blocks), capped by what
    kv_cache_memory holds, and at least one. Blocks beyond that demand could never all be in
    use, so they would be memory reserved for nothing. kv_cache_memory is the whole model's
    KV (all layers, all heads), whatever the number of workers that share it."""
    if config.num_blocks is not None:
        return config.num_blocks
    fmt = config.weight_format
    dtype_size = fmt.cache_dtype(fmt.compute_dtype).itemsize
    by_memory = config.kv_cache_memory // kv_bytes_per_block(cfg, config.block_size, dtype_size)
    by_demand = config.max_num_seqs * -(-max_model_len // config.block_size)
    return max(min(by_memory, by_demand), 1)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        executor: Executor,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.num_blocks = num_kv_blocks(config, model_config, max_model_len)
        self.kv = KVCacheManager(
            BlockPool(self.num_blocks),
            config.block_size,
            config.enable_prefix_caching,
            config.session_pin_ttl_s,
            config.max_pinned_fraction,
            config.max_pinned_sessions,
            config.max_pinned_sessions_per_tenant,
            window=droppable_window(config, model_config),
        )
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            max_model_len,
            config.speculative_config,
            config.request_timeout_s,
            config.schedules_ahead,
            config.priority_aging_s,
        )
        self.limits = config.request_limits(model_config.vocab_size, max_model_len)
        self.executor = executor
        fmt = config.weight_format
        compute = str(fmt.compute_dtype).removeprefix("torch.")
        self.formats = (planned_weights_label(config.model, fmt), fmt.dtype, compute)
        # Steps whose output came back: the number each output and timeline carries.
        self.num_steps = 0
        self._arrivals = 0
        self._in_flight: deque[InFlight] = deque()
        # Outputs made by a verb that then raised: the next verb to hand outputs over hands them first.
        self._unsent: list[EngineOutput] = []

    @classmethod
    def in_process(
        cls, config: EngineConfig, loaded: LoadedModel, thread: ThreadPoolExecutor | None = None, blocking: bool = True
    ) -> EngineCore:
        """The engine with its runner in this process, stepping on `thread` (the model thread)
        or, without one, on the caller's. blocking: step() from plain code (LLM); else
        step_async() on an event loop (InProcessClient)."""
        eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer else loaded.config.eos_token_ids
        planned = num_kv_blocks(config, loaded.config, loaded.max_model_len)
        config = dataclasses.replace(config, num_blocks=kv_pool_blocks(config, loaded, planned))
        runner = build_runner(config, loaded, config.num_blocks, eos)
        if thread is None and config.schedules_ahead:  # the next step computes while the caller applies the last
            thread = model_thread()
        return cls(config, loaded.config, loaded.max_model_len, eos, InProcessExecutor(runner, thread, blocking))

    @classmethod
    def load_on(
        cls, thread: ThreadPoolExecutor, config: EngineConfig, blocking: bool = True
    ) -> tuple[LoadedModel, EngineCore]:
        """Load the model and build the core on `thread`, which then runs the steps' model
        work: one OpenMP team in the process."""

        def build() -> tuple[LoadedModel, EngineCore]:
            loaded = load_model(config.model, config.weight_format, config.device, config.max_model_len)
            return loaded, cls.in_process(config, loaded, thread, blocking)

        return thread.submit(build).result()

    @property
    def runner(self) -> ModelRunner | None:
        """The model runner where it runs in this process (LLM, InProcessClient), else None."""
        return self.executor.runner if isinstance(self.executor, InProcessExecutor) else None

    @runner.setter
    def runner(self, runner: ModelRunner) -> None:
        """Tests swap in another runner (a fresh KV, other graphs); the next step runs on it."""
        if not isinstance(self.executor, InProcessExecutor):
            raise TypeError(f"the model runs in the {self.executor.kind} executor's workers, not here")
        self.executor.runner = runner

    @property
    def pipeline_depth(self) -> int:
        """Steps kept in flight: PIPELINE_DEPTH when scheduling ahead, else one at a time."""
        return PIPELINE_DEPTH if self.scheduler.schedule_ahead else 1

    @staticmethod
    def worth_dispatching(so: SchedulerOutput, steps_in_flight: int) -> bool:
        """Whether a step just scheduled should start: always into an empty pipeline; behind
        steps in flight only if it computes something or drops finished requests."""
        return not steps_in_flight or bool(so.total_num_scheduled_tokens or so.finished_req_ids)

    def add_request(self, req: EngineRequest) -> None:
        """Validate and queue; a request that can never run is refused here with the reason."""
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req = self._normalize(req)
        self._validate(req)
        self._arrivals += 1
        self.scheduler.add_request(Request(req, self.eos_token_ids, self._arrivals))

    def _normalize(self, req: EngineRequest) -> EngineRequest:
        """Priorities count only under the priority policy; max_tokens=None means as many as
        fit both the context and the KV pool (a request bigger than the pool would preempt
        itself and never be admitted again)."""
        if self.config.scheduling_policy == "fcfs" and req.priority:
            req = msgspec.structs.replace(req, priority=0)
        if req.sampling_params.max_tokens is None:
            # With a window the pool bounds what a request holds, not how long it runs.
            windowed = self.kv.window is not None
            kv_tokens = self.max_model_len if windowed else self.kv.pool.num_blocks * self.config.block_size
            room = max_tokens_to_fill(len(req.prompt_token_ids), self.max_model_len, kv_tokens)
            req.sampling_params = msgspec.structs.replace(req.sampling_params, max_tokens=room)
        return req

    def _validate(self, req: EngineRequest) -> None:
        prompt = req.prompt_token_ids
        check_request(req.sampling_params, prompt, self.limits)  # the context included
        blocks = self.kv.peak_blocks(len(prompt) + req.sampling_params.max_tokens, self.config.max_num_batched_tokens)
        if blocks > self.kv.pool.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks but the pool only has {self.kv.pool.num_blocks}; "
                "raise num_blocks / kv_cache_memory or lower max_tokens"
            )

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        """End these requests; the runner drops its copies with the next step."""
        return self._handed(self.scheduler.abort(request_ids))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Whether to step: requests to run, finished ones the runner has yet to hear of,
        steps in flight, or outputs not handed over."""
        s = self.scheduler
        return s.has_unfinished() or bool(s.finished_ids or self._in_flight or self._unsent)

    def step(self) -> list[EngineOutput]:
        """One step for a caller without an event loop (LLM): its executor's calls block."""
        return run_blocking(self.step_async()).outputs

    async def step_async(self) -> StepResult:
        """Fill the pipeline to its depth, then finish its oldest step: the next computes meanwhile."""
        while len(self._in_flight) < self.pipeline_depth and self._dispatch():
            pass
        if not self._in_flight:  # scheduling failed with nothing in flight
            return StepResult(self._handed([]), None)
        return await self._finish_oldest()

    def _dispatch(self) -> bool:
        """Plan a step and start it on the executor; False when there is nothing to start."""
        scheduled = time.monotonic()
        try:
            so = self.scheduler.schedule()
        except Exception as e:  # the scheduler's state is not to be trusted: every request fails
            self._internal_error("scheduling", e, list(self.scheduler.requests))
            return False
        self._unsent += self.scheduler.take_failed()
        if not self.worth_dispatching(so, len(self._in_flight)):
            return False
        dispatched = time.monotonic()
        self._in_flight.append(InFlight(so, self.executor.execute(so), scheduled, dispatched))
        return True

    async def _finish_oldest(self) -> StepResult:
        # Popped only once the call has ended: an owner cancelled while it computes (an event
        # loop closing) leaves it first in line, and the next step applies it.
        step = self._in_flight[0]
        try:
            out = await step.call
        except StepError as e:
            self._in_flight.popleft()
            log.error("a step failed (%s); failing its %d requests", e, len(step.so.num_scheduled_tokens))
            return StepResult(self._handed(self.fail_step(step.so, e)), None)
        # A WorkerFailure leaves the line as it is, for the owner's cancel_in_flight.
        self._in_flight.popleft()
        returned = time.monotonic()
        self.num_steps += 1
        try:
            outputs = self.scheduler.update(step.so, out)
        except Exception as e:
            self._internal_error("processing a step's output", e, list(step.so.num_scheduled_tokens))
            return StepResult(self._handed([]), None)
        for output in outputs:
            output.step = self.num_steps
        timing = _timing(self.num_steps, step, out, returned) if out.timing else None  # not bookkeeping alone
        return StepResult(self._handed(outputs), timing)

    def _internal_error(self, where: str, error: Exception, request_ids: list[str]) -> None:
        """Fail the requests an engine error concerns, never silently; EngineBroken if the
        scheduler's state is then inconsistent."""
        log.exception("engine error while %s; failing %d requests", where, len(request_ids))
        message = f"internal engine error while {where}: {type(error).__name__}: {error}"
        try:
            self._unsent += self.scheduler.fail(request_ids, message)
            self.scheduler.check_invariants()
        except Exception as e:
            raise EngineBroken(f"{message}; then {type(e).__name__}: {e}") from e

    def _handed(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        ready, self._unsent = self._unsent + outputs, []
        return ready

    def fail_step(self, so: SchedulerOutput, error: StepError) -> list[EngineOutput]:
        """The step raised in the model: its requests fail alone (StepError names the cause)."""
        return self.scheduler.fail(list(so.num_scheduled_tokens), f"the request failed during a step: {error}")

    def fail_all(self, error: str) -> list[EngineOutput]:
        """End every request with an error (the engine cannot go on) and free all its blocks;
        should the scheduler fail even that, still end every request it names."""
        try:
            outputs = self.scheduler.fail(list(self.scheduler.requests), error)
            self.scheduler.finished_ids.clear()
        except Exception:
            log.exception("failing every request")
            outputs = [
                EngineOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=error)
                for rid in list(self.scheduler.requests)
            ]
        return self._handed(outputs)

    async def cancel_in_flight(self) -> None:
        """Abandon the steps in flight (the workers they ran on are lost) and wait until
        their calls have ended."""
        steps, self._in_flight = list(self._in_flight), deque()
        for step in steps:
            step.call.cancel()
        await asyncio.gather(*(step.call for step in steps), return_exceptions=True)

    def reset_after_worker_loss(self, error: str) -> list[EngineOutput]:
        """Running requests fail, waiting ones run again from their tokens, nothing cached
        survives (Scheduler.reset_after_worker_loss); steps still in line, planned on the lost
        KV, are dropped."""
        for step in self._in_flight:
            step.call.cancel()
        self._in_flight.clear()
        return self._handed(self.scheduler.reset_after_worker_loss(error))

    def stats(self) -> EngineStats:
        s = self.scheduler
        spec = s.spec_stats if s.spec is not None else None
        return EngineStats(
            len(s.running), len(s.waiting), s.num_preemptions, self.kv.pool.stats(), spec, *self.formats,
            self.executor.weight_bytes, num_pinned_blocks=self.kv.pins.num_pinned_blocks, step_tokens=s.step_tokens,
        )  # fmt: skip

    def serving_stats(self, num_worker_restarts: int = 0) -> ServingStats:
        """What an engine client's stats() answers, for every owner alike."""
        executor = self.executor
        return ServingStats(
            engine=self.stats(),
            num_workers=executor.num_workers,
            worker_pids=list(executor.pids),
            num_worker_restarts=num_worker_restarts,
            num_steps=self.num_steps,
            compiled_graph=executor.compiled_graph,
            engine_pid=os.getpid(),
            executor=executor.kind,
        )


def run_blocking(step: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine whose awaits all block instead of suspending (a blocking executor's
    calls) to its end, here, with no event loop: the one step loop then serves LLM's plain
    calls as well as the event loops of the engine actor and InProcessClient."""
    try:
        step.send(None)
    except StopIteration as done:
        return done.value
    step.close()
    raise RuntimeError("the step waited on an event loop: step() needs a blocking executor; await step_async()")


def _timing(number: int, step: InFlight, out: ModelRunnerOutput, returned: float) -> StepTiming:
    started, forwarded, sampled = out.timing
    so = step.so
    return StepTiming(
        number, len(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
        step.scheduled, step.dispatched, started, forwarded, sampled, returned, time.monotonic(),
    )  # fmt: skip
