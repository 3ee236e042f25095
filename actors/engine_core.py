"""EngineCore: scheduler + block pool, and (in-process) the model runner, stepped by its owner.

The engine actor uses the same core without a runner: it schedules here, executes on its
worker actors, and feeds their output back through update().

With async scheduling (EngineConfig.async_scheduling) the in-process core keeps
PIPELINE_DEPTH steps in flight on its step thread: step() plans and submits the next step,
then waits for the oldest one and applies its outputs while the next computes."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from cadenza.actors.block_pool import BlockPool
from cadenza.actors.device_samples import landed
from cadenza.actors.kv_cache_manager import KVCacheManager
from cadenza.actors.model_runner import ModelRunner
from cadenza.actors.request import Request
from cadenza.actors.runner_setup import build_runner, kv_pool_blocks
from cadenza.actors.scheduler import Scheduler
from cadenza.config import EngineConfig
from cadenza.messages import EngineOutput, EngineRequest, ModelRunnerOutput, SchedulerOutput
from cadenza.models.config import ModelConfig
from cadenza.models.loader import LoadedModel, load_model, planned_weights_label
from cadenza.request_limits import check_request, max_tokens_to_fill
from cadenza.stats import EngineStats

log = logging.getLogger(__name__)

# Steps in flight at once when scheduling ahead: one computing, the next queued behind it.
# A deeper queue would only plan further on placeholders; the model is never kept waiting at 2.
PIPELINE_DEPTH = 2


def model_thread() -> ThreadPoolExecutor:
    """A thread for all of a process's model work, its load and its steps. With libgomp each
    thread that runs torch ops keeps an OpenMP team of its own, and once the teams' threads
    outnumber the cores none of them spins between parallel regions: each region then pays a
    futex wake (SmolLM2's CPU decode ran 1.7x slower with a second team alive)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadenza-model")


def kv_bytes_per_block(cfg: ModelConfig, block_size: int, dtype_size: int) -> int:
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype_size


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
        runner: ModelRunner | None = None,
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
        self.runner = runner
        self._arrivals = 0
        fmt = config.weight_format
        compute = str(fmt.compute_dtype).removeprefix("torch.")
        self.formats = (planned_weights_label(config.model, fmt), fmt.dtype, compute)
        # Resident weight bytes for stats(), where the model is not this core's runner's (the
        # engine actor's workers hold it): whoever holds the model may report it here.
        self.weight_bytes = 0
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()
        # Ahead, where the runner's steps run (LLM hands over the thread it loaded the model on).
        self.step_thread: ThreadPoolExecutor | None = None

    @property
    def pipeline_depth(self) -> int:
        """Steps kept in flight: PIPELINE_DEPTH when scheduling ahead, else one at a time."""
        return PIPELINE_DEPTH if self.scheduler.schedule_ahead else 1

    @staticmethod
    def worth_dispatching(so: SchedulerOutput, steps_in_flight: int) -> bool:
        """Whether a step just scheduled should start: always into an empty pipeline; behind
        steps in flight only if it computes something or drops finished requests."""
        return not steps_in_flight or bool(so.total_num_scheduled_tokens or so.finished_req_ids)

    @classmethod
    def in_process(cls, config: EngineConfig, loaded: LoadedModel) -> EngineCore:
        eos = loaded.tokenizer.eos_token_ids if loaded.tokenizer else loaded.config.eos_token_ids
        planned = num_kv_blocks(config, loaded.config, loaded.max_model_len)
        config = dataclasses.replace(config, num_blocks=kv_pool_blocks(config, loaded, planned))
        core = cls(config, loaded.config, loaded.max_model_len, eos)
        core.runner = build_runner(config, loaded, core.num_blocks, eos)
        return core

    @classmethod
    def load_on(cls, thread: ThreadPoolExecutor, config: EngineConfig) -> tuple[LoadedModel, EngineCore]:
        """Load the model and build the core on `thread`, which then runs the steps' model
        work when scheduling ahead (step_thread): one OpenMP team in the process."""

        def build() -> tuple[LoadedModel, EngineCore]:
            loaded = load_model(config.model, config.weight_format, config.device, config.max_model_len)
            return loaded, cls.in_process(config, loaded)

        loaded, core = thread.submit(build).result()
        core.step_thread = thread
        return loaded, core

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
            kv_tokens = self.kv.pool.num_blocks * self.config.block_size
            room = max_tokens_to_fill(len(req.prompt_token_ids), self.max_model_len, kv_tokens)
            req.sampling_params = msgspec.structs.replace(req.sampling_params, max_tokens=room)
        return req

    def _validate(self, req: EngineRequest) -> None:
        prompt = req.prompt_token_ids
        check_request(req.sampling_params, prompt, self.limits)  # the context included
        blocks = self.kv.blocks_needed(len(prompt) + req.sampling_params.max_tokens)
        if blocks > self.kv.pool.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks but the pool only has {self.kv.pool.num_blocks}; "
                "raise num_blocks / kv_cache_memory or lower max_tokens"
            )

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        return self.scheduler.abort(request_ids)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        """One step in this process. An exception from the runner fails the step's requests
        alone: nothing else was touched, and the runner drops them with the next step."""
        if self.scheduler.schedule_ahead:
            return self._step_ahead()
        so = self.scheduler.schedule()
        failed = self.scheduler.take_failed()
        try:
            out = self.runner.execute(so)
        except Exception as e:
            log.exception("a step failed; failing its requests")
            return failed + self.fail_step(so, e)
        return failed + self.scheduler.update(so, out)

    def _step_ahead(self) -> list[EngineOutput]:
        """Fill the pipeline, then finish its oldest step: the next is computing meanwhile."""
        failed = []
        while len(self._in_flight) < PIPELINE_DEPTH:
            so = self.scheduler.schedule()
            failed += self.scheduler.take_failed()
            if not self.worth_dispatching(so, len(self._in_flight)):
                break
            if self.step_thread is None:
                self.step_thread = model_thread()
            self._in_flight.append((so, self.step_thread.submit(self.runner.execute, so)))
        so, future = self._in_flight.popleft()
        try:
            out = landed(future.result())  # its samples reach the host while the next step computes
        except Exception as e:
            log.exception("a step failed; failing its requests")
            return failed + self.fail_step(so, e)
        return failed + self.scheduler.update(so, out)

    def fail_step(self, so: SchedulerOutput, error: BaseException) -> list[EngineOutput]:
        message = f"the request failed during a step: {type(error).__name__}: {error}"
        return self.scheduler.fail(list(so.num_scheduled_tokens), message)

    def fail_all(self, error: str) -> list[EngineOutput]:
        """End every request with an error (the engine cannot go on) and free all its blocks."""
        outputs = self.scheduler.fail(list(self.scheduler.requests), error)
        self.scheduler.finished_ids.clear()
        return outputs

    def reset_after_worker_loss(self, error: str) -> list[EngineOutput]:
        return self.scheduler.reset_after_worker_loss(error)

    def stats(self) -> EngineStats:
        s = self.scheduler
        spec = s.spec_stats if s.spec is not None else None
        weights = self.runner.model.weight_bytes() if self.runner is not None else self.weight_bytes
        return EngineStats(
            len(s.running), len(s.waiting), s.num_preemptions, self.kv.pool.stats(), spec, *self.formats, weights,
            num_pinned_blocks=self.kv.pins.num_pinned_blocks,
        )  # fmt: skip
