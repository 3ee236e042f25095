"""EngineActor: the Ray actor that owns the scheduler and the KV block allocator and runs the
step loop while there is work: on the model runner in its own process (LocalExecutor, TP = PP
= 1) or on its worker actors (RayExecutor).

Every method takes and returns message Structs (cadenza.messages, cadenza.stats) or builtins;
Ray sends the Structs as msgpack (cadenza.actors.codec). Outputs go back batched: one
OutputBatch carries every request's deltas since the client's last acknowledged one, never a
message per token, with the StepTiming of each step that produced them. A client on this
node reads them from the output socket as they are published (actors/output_stream.py);
one elsewhere keeps a `get_outputs` call parked here. Either way a step's outputs leave
while the next step computes. A failed step ends the in-flight requests with an error and
rebuilds the workers. With async scheduling, step N + 1 is planned and dispatched before step
N's outputs are back (engine_core.PIPELINE_DEPTH steps in flight), so the executor always has
the next step queued while the engine applies and publishes the last.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

import ray

from cadenza.actors import codec
from cadenza.actors.local_ray import unnice_worker
from cadenza.actors.output_stream import OutputServer
from cadenza.actors.step_errors import StepError, WorkerFailure
from cadenza.config import EngineConfig
from cadenza.messages import EngineOutput, EngineRequest, ModelRunnerOutput, OutputBatch, SchedulerOutput, StepTiming
from cadenza.stats import ServingStats

# The engine's own modules (scheduler, executors, and through them torch) are imported in the
# actor's process, in __init__: a client that only creates the actor (the gateway) never
# loads them, which keeps torch (~190 MB resident) out of the gateway.
if TYPE_CHECKING:
    from cadenza.actors.executor import RayExecutor
    from cadenza.actors.local_executor import LocalExecutor

log = logging.getLogger(__name__)

# Timelines of steps that published no output yet (mid-prompt chunks) wait for the next batch;
# past this many the oldest are dropped (a client that stopped reading must not grow them).
MAX_PENDING_TIMINGS = 256


class InFlight(NamedTuple):
    """A dispatched step: its plan, the executor call, and when it was scheduled / dispatched."""

    so: SchedulerOutput
    call: asyncio.Task[ModelRunnerOutput]
    scheduled: float
    dispatched: float


class EngineActor:
    def __init__(self, config: EngineConfig) -> None:
        codec.register()  # before anything is sent: the workers' specs, every step
        from cadenza.actors.engine_core import EngineCore
        from cadenza.actors.executor import RayExecutor
        from cadenza.actors.local_executor import LocalExecutor
        from cadenza.models.model_files import load_tokenizer, max_model_len, read_model

        unnice_worker()
        path, model_config = read_model(config.model)
        tokenizer = load_tokenizer(path, model_config)
        eos = tokenizer.eos_token_ids if tokenizer else model_config.eos_token_ids
        self.core = EngineCore(config, model_config, max_model_len(model_config, config.max_model_len), eos)
        executor = LocalExecutor if config.executor_kind == "local" else RayExecutor
        self.executor: LocalExecutor | RayExecutor = executor(config, self.core.num_blocks, eos)
        # Published batches are kept until the client acknowledges them, so a client whose
        # event loop went away mid-call loses nothing: its next call simply asks again.
        self._batches: list[tuple[int, list[EngineOutput], list[StepTiming]]] = []
        self._timings: deque[StepTiming] = deque(maxlen=MAX_PENDING_TIMINGS)
        self._published = 0
        self._new_batch = asyncio.Event()
        self._fatal: str | None = None
        self._has_work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._restarts = 0
        self._steps = 0
        self._output_server: OutputServer | None = None
        self._in_flight: deque[InFlight] = deque()

    async def start(self) -> int:
        """Place and load the workers, then start stepping. Returns max_model_len."""
        try:
            await self.executor.start()
        except BaseException:
            self.executor.shutdown()  # do not leave a half-built group holding resources
            raise
        if self.executor.num_blocks != self.core.num_blocks:  # on CUDA the workers sized the pool
            self._resize_pool(self.executor.num_blocks)
        self.core.weight_bytes = self.executor.weight_bytes
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        self._loop_task.add_done_callback(self._on_loop_exit)
        return self.core.max_model_len

    def _resize_pool(self, num_blocks: int) -> None:
        """A fresh core over the pool the workers allocated (before any request: nothing is lost)."""
        from cadenza.actors.engine_core import EngineCore

        core = self.core
        config = dataclasses.replace(core.config, num_blocks=num_blocks)
        self.core = EngineCore(config, core.model_config, core.max_model_len, core.eos_token_ids)

    async def add_request(self, request: EngineRequest) -> str | None:
        """Queue a request; a refused one returns the reason (nothing is raised across actors)."""
        if self._fatal:
            return self._fatal
        try:
            self.core.add_request(request)
        except ValueError as e:
            return str(e)
        self._has_work.set()
        return None

    async def abort(self, request_ids: list[str]) -> None:
        self._publish(self.core.abort(request_ids))
        self._has_work.set()  # so the workers hear of it and drop their copies

    async def get_outputs(self, ack: int) -> OutputBatch:
        """Wait until a batch after `ack` exists, then hand over all of them at once."""
        self._acknowledge(ack)
        return await self._batches_after(ack)

    async def output_socket(self) -> tuple[str, str]:
        """(node id, path) of the socket that streams the batches to a client on this node
        (actors/output_stream.py), started on first use."""
        if self._output_server is None:
            self._output_server = OutputServer(self._batches_after, self._acknowledge)
            await self._output_server.start()
        return ray.get_runtime_context().get_node_id(), self._output_server.path

    def _acknowledge(self, ack: int) -> None:
        self._batches = [b for b in self._batches if b[0] > ack]

    async def _batches_after(self, ack: int) -> OutputBatch:
        while self._published <= ack:
            await self._new_batch.wait()
        fresh = [b for b in self._batches if b[0] > ack]
        outputs = [out for _, batch, _ in fresh for out in batch]
        return OutputBatch(last=self._published, outputs=outputs, timings=[t for *_, ts in fresh for t in ts])

    async def health(self) -> str | None:
        """None when serving; else why not."""
        return self._fatal

    async def stats(self) -> ServingStats:
        return ServingStats(
            engine=self.core.stats(),
            num_workers=len(self.executor.workers),
            executor=self.executor.kind,
            worker_pids=list(self.executor.pids),
            num_worker_restarts=self._restarts,
            num_steps=self._steps,
            compiled_graph=self.executor.graph is not None,
            engine_pid=os.getpid(),
        )

    async def workers(self) -> list:
        """The worker actor handles (for operators and fault-injection tests)."""
        return self.executor.workers

    async def shutdown(self) -> None:
        """Stop stepping, kill the workers and release their placement group."""
        if self._loop_task is not None:
            self._loop_task.cancel()
        if self._output_server is not None:
            self._output_server.close()
        self.executor.shutdown()

    def _publish(self, outputs: list[EngineOutput]) -> None:
        if outputs:
            self._published += 1
            self._batches.append((self._published, outputs, list(self._timings)))
            self._timings.clear()
            self._new_batch.set()
            self._new_batch = asyncio.Event()

    async def _loop(self) -> None:
        while True:
            idle = not self.core.has_unfinished() and not self.core.scheduler.finished_ids
            if idle and not self._in_flight:
                self._has_work.clear()
                await self._has_work.wait()
                continue
            await self._step()

    async def _step(self) -> None:
        """Dispatch steps up to the pipeline's depth (1 unless scheduling ahead), then finish
        the oldest. A failure fails the requests it concerns: the step's own when a live
        worker raised or processing its output did; every request when scheduling itself broke
        (the scheduler's state is not to be trusted); never silently."""
        while len(self._in_flight) < self.core.pipeline_depth and self._dispatch():
            pass
        if self._in_flight:
            await self._finish_step(self._in_flight.popleft())

    def _dispatch(self) -> bool:
        """Schedule a step and start it on the executor; False when there is nothing to start."""
        core = self.core
        scheduled = time.monotonic()
        try:
            so = core.scheduler.schedule()
        except Exception as e:
            self._internal_error("scheduling", e, list(core.scheduler.requests))
            return False
        self._publish(core.scheduler.take_failed())
        if not core.worth_dispatching(so, len(self._in_flight)):
            return False
        call = asyncio.ensure_future(self.executor.execute(so))
        self._in_flight.append(InFlight(so, call, scheduled, time.monotonic()))
        return True

    async def _finish_step(self, step: InFlight) -> None:
        core, so, scheduled, dispatched = self.core, step.so, step.scheduled, step.dispatched
        try:
            out = await step.call
        except StepError as e:
            log.error("a step failed in a worker (%s); failing its %d requests", e, len(so.num_scheduled_tokens))
            self._publish(core.fail_step(so, e))
            return
        except WorkerFailure as e:
            await self._recover(str(e))
            return
        returned = time.monotonic()
        self._steps += 1
        try:
            outputs = core.scheduler.update(so, out)
        except Exception as e:
            self._internal_error("processing a step's output", e, list(so.num_scheduled_tokens))
            return
        for output in outputs:
            output.step = self._steps
        if out.timing:  # a step that ran the model (not bookkeeping alone)
            self._timings.append(_timing(self._steps, so, out, scheduled, dispatched, returned))
        self._publish(outputs)

    def _internal_error(self, where: str, error: Exception, request_ids: list[str]) -> None:
        log.exception("engine error while %s; failing %d requests", where, len(request_ids))
        message = f"internal engine error while {where}: {type(error).__name__}: {error}"
        try:
            self._publish(self.core.scheduler.fail(request_ids, message))
            self.core.scheduler.check_invariants()
        except Exception as e:  # the state itself is broken: stop serving, and say why
            self._go_fatal(f"{message}; then {type(e).__name__}: {e}")

    def _go_fatal(self, reason: str) -> None:
        """The engine cannot go on: /health reports the reason and no caller waits forever."""
        self._fatal = reason
        log.error(reason)
        try:
            outputs = self.core.fail_all(reason)
        except Exception:  # fail every request we can still name, whatever the scheduler says
            outputs = [
                EngineOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=reason)
                for rid in list(self.core.scheduler.requests)
            ]
        self._publish(outputs)

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._fatal:
            return
        error = task.exception()
        self._go_fatal(f"the engine loop stopped: {type(error).__name__}: {error}")

    async def _recover(self, error: str) -> None:
        log.error("%s; failing running requests and rebuilding the workers", error)
        in_flight, self._in_flight = list(self._in_flight), deque()
        for step in in_flight:  # planned on the lost KV: their outputs mean nothing now
            step.call.cancel()
        await asyncio.gather(*(step.call for step in in_flight), return_exceptions=True)
        # The KV is gone with the workers: no prefix-cache entry or block table survives it.
        self._publish(self.core.reset_after_worker_loss(error))
        self._restarts += 1
        try:
            await self.executor.restart()
        except Exception as e:  # e.g. the cluster lost the resources: refuse work from now on
            self._go_fatal(f"the engine could not rebuild its workers: {type(e).__name__}: {e}")
            raise


def _timing(
    step: int, so: SchedulerOutput, out: ModelRunnerOutput, scheduled: float, dispatched: float, returned: float
) -> StepTiming:
    started, forwarded, sampled = out.timing
    return StepTiming(
        step, len(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
        scheduled, dispatched, started, forwarded, sampled, returned, time.monotonic(),
    )  # fmt: skip
