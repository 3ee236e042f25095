"""EngineActor: the Ray actor that holds the engine core (scheduler, KV block allocator and
its step loop, actors/engine_core.py) and steps it while there is work, on the model runner in
its own process (LocalExecutor, TP = PP = 1) or on its worker actors (RayExecutor). What is
left here is transport, recovery and stats.

Every method takes and returns message Structs (cadenza.messages, cadenza.stats) or builtins;
Ray sends the Structs as msgpack (cadenza.actors.codec). Outputs go back batched: one
OutputBatch carries every request's deltas since the client's last acknowledged one, never a
message per token, with the StepTiming of each step that produced them. A client on this
node reads them from the output socket as they are published (actors/output_stream.py);
one elsewhere keeps a `get_outputs` call parked here. Either way a step's outputs leave
while the next step computes (with async scheduling, engine_core.PIPELINE_DEPTH steps are in
flight). A lost worker ends the running requests with an error and the workers are rebuilt;
an engine whose own state broke stops serving and says why (health).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import deque
from typing import TYPE_CHECKING

import ray

from cadenza.actors import codec
from cadenza.actors.heap_trim import trim_heap
from cadenza.actors.kv_connector.engine_port import EnginePort
from cadenza.actors.kv_connector.handoff import KVHandoff, KVImport
from cadenza.actors.local_ray import unnice_worker
from cadenza.actors.output_stream import OutputServer
from cadenza.actors.step_errors import WorkerFailure
from cadenza.config import EngineConfig
from cadenza.messages import EngineOutput, EngineRequest, OutputBatch, Refusal, StepTiming
from cadenza.stats import ServingStats

# The engine's own modules (scheduler, executors, and through them torch) are imported in the
# actor's process, in __init__: a client that only creates the actor (the gateway) never
# loads them, which keeps torch (~190 MB resident) out of the gateway.
if TYPE_CHECKING:
    from cadenza.actors.engine_core import EngineCore
    from cadenza.actors.executor_base import WorkerExecutor

log = logging.getLogger(__name__)

# Timelines of steps that published no output yet (mid-prompt chunks) wait for the next batch;
# past this many the oldest are dropped (a client that stopped reading must not grow them).
MAX_PENDING_TIMINGS = 256


class EngineActor:
    def __init__(self, config: EngineConfig) -> None:
        codec.register()  # before anything is sent: the workers' specs, every step
        from cadenza.actors.engine_core import EngineCore, num_kv_blocks
        from cadenza.actors.executor import RayExecutor
        from cadenza.actors.local_executor import LocalExecutor
        from cadenza.models.model_files import load_tokenizer, max_model_len, read_model

        unnice_worker()
        path, model_config = read_model(config.model)
        # The tokenizer only where the config names no EOS (it would name the same ones): this
        # process never needs it otherwise, and it holds ~37 MB (its workers build theirs for
        # grammars, on first use).
        eos = model_config.eos_token_ids
        if not eos and (tokenizer := load_tokenizer(path, model_config)) is not None:
            eos = tokenizer.eos_token_ids
        max_len = max_model_len(model_config, config.max_model_len)
        executor = LocalExecutor if config.executor_kind == "local" else RayExecutor
        self.executor: WorkerExecutor = executor(config, num_kv_blocks(config, model_config, max_len), eos)
        self.core: EngineCore = EngineCore(config, model_config, max_len, eos, self.executor)
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
        self._output_server: OutputServer | None = None

    async def start(self) -> int:
        """Place and load the workers, then start stepping. Returns max_model_len."""
        try:
            await self.executor.start()
        except BaseException:
            self.executor.shutdown()  # do not leave a half-built group holding resources
            raise
        if self.executor.num_blocks != self.core.num_blocks:  # on CUDA the workers sized the pool
            self._resize_pool(self.executor.num_blocks)
        config = self.core.config
        self.port = EnginePort(self.core.kv, self.executor, config.kv_lease_s, config.shares_kv)
        self._loop_task = asyncio.get_running_loop().create_task(self._loop())
        self._loop_task.add_done_callback(self._on_loop_exit)
        return self.core.max_model_len

    def _resize_pool(self, num_blocks: int) -> None:
        """A fresh core over the pool the workers allocated (before any request: nothing is lost)."""
        from cadenza.actors.engine_core import EngineCore

        core = self.core
        config = dataclasses.replace(core.config, num_blocks=num_blocks)
        self.core = EngineCore(config, core.model_config, core.max_model_len, core.eos_token_ids, self.executor)

    async def add_request(self, request: EngineRequest) -> Refusal | None:
        """Queue a request; a refused one returns why (nothing is raised across actors)."""
        if self._fatal:
            return Refusal("dead", self._fatal)
        try:
            self.core.add_request(request)
        except ValueError as e:
            return Refusal("invalid", str(e))
        self._has_work.set()
        return None

    async def abort(self, request_ids: list[str]) -> None:
        self._publish(self.core.abort(request_ids))
        self._has_work.set()  # so the workers hear of it and drop their copies

    async def export_kv(
        self,
        token_ids: list[int],
        cache_salt: str | None,
        skip: int = 0,
        wait_s: float = 0.0,
        pull_at: list[str] | None = None,
    ) -> tuple[KVHandoff, list[ray.ObjectRef]]:
        """The KV connector: the cached blocks of token_ids' prefix after the first `skip`, for
        another engine (leased, for one whose workers are at pull_at to copy out); with wait_s,
        once the prefill caching them has added one (EnginePort)."""
        return await self.port.export(token_ids, cache_salt, skip, wait_s, pull_at)

    async def release_kv(self, lease: int) -> None:
        """The KV connector: a pull of leased blocks is over."""
        self.port.release(lease)

    async def kv_places(self) -> list[str] | None:
        """Where the workers are, for an exporter to lease blocks this engine pulls (or None)."""
        return await self.port.places()

    async def export_pinned(self, also: list[bytes]) -> tuple[KVHandoff, list[ray.ObjectRef]]:
        """The KV connector: every block session pins hold (and those of `also` still cached),
        for the engine taking over (a drain)."""
        return await self.port.export_pinned(also)

    async def import_kv(self, handoff: KVHandoff, refs: list[ray.ObjectRef]) -> KVImport:
        """The KV connector: another engine's blocks into this prefix cache (held ones skipped)."""
        return await self.port.import_(handoff, refs)

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
        return self.core.serving_stats(self._restarts)

    async def workers(self) -> list[ray.actor.ActorHandle]:
        """The worker actors (for operators and fault-injection tests); none when the model
        runs in this actor's process."""
        from cadenza.actors.executor import RayExecutor

        return self.executor.workers if isinstance(self.executor, RayExecutor) else []

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
            if not self.core.has_work():
                self._has_work.clear()
                trim_heap()  # idle after work: what the batch's buffers freed goes back to the OS
                await self._has_work.wait()
                continue
            await self._step()

    async def _step(self) -> None:
        """One step of the core's loop, its outputs published. A lost worker is recovered from
        here; anything else the core raises (EngineBroken: its own state is not to be
        trusted) ends the loop, and _on_loop_exit stops serving with the reason."""
        try:
            outputs, timing = await self.core.step_async()
        except WorkerFailure as e:
            await self._recover(str(e))
            return
        if timing is not None:
            self._timings.append(timing)
        self.port.step_done()
        self._publish(outputs)

    def _go_fatal(self, reason: str) -> None:
        """The engine cannot go on: /health reports the reason and no caller waits forever."""
        self._fatal = reason
        log.error(reason)
        self._publish(self.core.fail_all(reason))

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or self._fatal:
            return
        error = task.exception()
        self._go_fatal(f"the engine loop stopped: {type(error).__name__}: {error}")

    async def _recover(self, error: str) -> None:
        log.error("%s; failing running requests and rebuilding the workers", error)
        await self.core.cancel_in_flight()  # planned on the lost KV: their outputs mean nothing now
        self.port.drop_leases()
        # The KV is gone with the workers: no prefix-cache entry or block table survives it.
        self._publish(self.core.reset_after_worker_loss(error))
        self._restarts += 1
        try:
            await self.executor.restart()
        except Exception as e:  # e.g. the cluster lost the resources: refuse work from now on
            self._go_fatal(f"the engine could not rebuild its workers: {type(e).__name__}: {e}")
            raise
