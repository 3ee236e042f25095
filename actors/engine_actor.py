"""EngineActor: the Ray actor that owns the scheduler and the KV block allocator and runs the
step loop over its worker actors while there is work.

Every method takes and returns message Structs (cadenza.messages, cadenza.stats) or builtins;
Ray sends the Structs as msgpack (cadenza.actors.codec). Outputs go back batched: one
`get_outputs` answer carries every request's deltas since the last one, never a message per
token. A failed step ends the in-flight requests with an error and rebuilds the workers.
"""

from __future__ import annotations

import asyncio
import logging
import os

from cadenza.actors import codec
from cadenza.actors.engine_core import EngineCore
from cadenza.actors.executor import RayExecutor, StepError, WorkerFailure
from cadenza.config import EngineConfig
from cadenza.messages import EngineOutput, EngineRequest, OutputBatch
from cadenza.models.loader import load_tokenizer, max_model_len, read_model
from cadenza.stats import ServingStats

log = logging.getLogger(__name__)


class EngineActor:
    def __init__(self, config: EngineConfig) -> None:
        codec.register()  # before anything is sent: the workers' specs, every step
        path, model_config = read_model(config.model)
        tokenizer = load_tokenizer(path, model_config)
        eos = tokenizer.eos_token_ids if tokenizer else model_config.eos_token_ids
        self.core = EngineCore(config, model_config, max_model_len(model_config, config.max_model_len), eos)
        self.executor = RayExecutor(config, self.core.num_blocks, eos)
        # Published batches are kept until the client acknowledges them, so a client whose
        # event loop went away mid-call loses nothing: its next call simply asks again.
        self._batches: list[tuple[int, list[EngineOutput]]] = []
        self._published = 0
        self._new_batch = asyncio.Event()
        self._fatal: str | None = None
        self._has_work = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._restarts = 0
        self._steps = 0

    async def start(self) -> int:
        """Place and load the workers, then start stepping. Returns max_model_len."""
        try:
            await self.executor.start()
        except BaseException:
            self.executor.shutdown()  # do not leave a half-built group holding resources
            raise
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        self._loop_task.add_done_callback(self._on_loop_exit)
        return self.core.max_model_len

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
        self._batches = [b for b in self._batches if b[0] > ack]
        while self._published <= ack:
            await self._new_batch.wait()
        outputs = [out for n, batch in self._batches if n > ack for out in batch]
        return OutputBatch(last=self._published, outputs=outputs)

    async def health(self) -> str | None:
        """None when serving; else why not."""
        return self._fatal

    async def stats(self) -> ServingStats:
        return ServingStats(
            engine=self.core.stats(),
            num_workers=len(self.executor.workers),
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
        self.executor.shutdown()

    def _publish(self, outputs: list[EngineOutput]) -> None:
        if outputs:
            self._published += 1
            self._batches.append((self._published, outputs))
            self._new_batch.set()
            self._new_batch = asyncio.Event()

    async def _loop(self) -> None:
        while True:
            if not self.core.has_unfinished() and not self.core.scheduler.finished_ids:
                self._has_work.clear()
                await self._has_work.wait()
                continue
            await self._step()

    async def _step(self) -> None:
        """One step. A failure fails the requests it concerns: the step's own when a live
        worker raised or processing its output did; every request when scheduling itself broke
        (the scheduler's state is not to be trusted); never silently."""
        core = self.core
        try:
            so = core.scheduler.schedule()
        except Exception as e:
            self._internal_error("scheduling", e, list(core.scheduler.requests))
            return
        self._publish(core.scheduler.take_failed())
        try:
            out = await self.executor.execute(so)
        except StepError as e:
            log.error("a step failed in a worker (%s); failing its %d requests", e, len(so.num_scheduled_tokens))
            self._publish(core.fail_step(so, e))
            return
        except WorkerFailure as e:
            await self._recover(str(e))
            return
        self._steps += 1
        try:
            self._publish(core.scheduler.update(so, out))
        except Exception as e:
            self._internal_error("processing a step's output", e, list(so.num_scheduled_tokens))

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
        # The KV is gone with the workers: no prefix-cache entry or block table survives it.
        self._publish(self.core.reset_after_worker_loss(error))
        self._restarts += 1
        try:
            await self.executor.restart()
        except Exception as e:  # e.g. the cluster lost the resources: refuse work from now on
            self._go_fatal(f"the engine could not rebuild its workers: {type(e).__name__}: {e}")
            raise
