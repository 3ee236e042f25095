"""EngineActor: the Ray actor that owns the scheduler and the KV block allocator and runs the
step loop over its worker actors while there is work.

Every method takes and returns msgpack bytes of msgspec Structs. Outputs go back batched:
one `get_outputs` answer carries every request's deltas since the last one, never a message
per token. A failed step ends the in-flight requests with an error and rebuilds the workers.
"""

from __future__ import annotations

import asyncio
import logging
import os

import msgspec
from cadenza.actors.engine_core import EngineCore, EngineStats
from cadenza.actors.executor import RayExecutor, WorkerFailure
from cadenza.models.loader import load_tokenizer, max_model_len, read_model

from cadenza.config import EngineConfig
from cadenza.messages import EngineOutput, EngineRequest

log = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(EngineRequest)


class OutputBatch(msgspec.Struct, kw_only=True):
    """Every delta published after the client's acknowledged batch, up to batch `last`."""

    last: int
    outputs: list[EngineOutput]


class ActorStats(msgspec.Struct, kw_only=True):
    engine: EngineStats
    num_workers: int
    worker_pids: list[int]
    num_worker_restarts: int
    num_steps: int
    compiled_graph: bool  # steps run as a Ray Compiled Graph (else plain actor calls)
    engine_pid: int


class EngineActor:
    def __init__(self, config: bytes) -> None:
        cfg = msgspec.msgpack.decode(config, type=EngineConfig)
        path, model_config = read_model(cfg.model)
        tokenizer = load_tokenizer(path, model_config)
        eos = tokenizer.eos_token_ids if tokenizer else model_config.eos_token_ids
        self.core = EngineCore(cfg, model_config, max_model_len(model_config, cfg.max_model_len), eos)
        self.executor = RayExecutor(cfg, self.core.num_blocks, eos)
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
        return self.core.max_model_len

    async def add_request(self, request: bytes) -> str | None:
        """Queue a request; a refused one returns the reason (nothing is raised across actors)."""
        if self._fatal:
            return self._fatal
        try:
            self.core.add_request(_request_decoder.decode(request))
        except (ValueError, msgspec.ValidationError) as e:
            return str(e)
        self._has_work.set()
        return None

    async def abort(self, request_ids: list[str]) -> None:
        self._publish(self.core.abort(request_ids))
        self._has_work.set()  # so the workers hear of it and drop their copies

    async def get_outputs(self, ack: int) -> bytes:
        """Wait until a batch after `ack` exists, then hand over all of them at once."""
        self._batches = [b for b in self._batches if b[0] > ack]
        while self._published <= ack:
            await self._new_batch.wait()
        outputs = [out for n, batch in self._batches if n > ack for out in batch]
        return _encoder.encode(OutputBatch(last=self._published, outputs=outputs))

    async def health(self) -> str | None:
        """None when serving; else why not."""
        return self._fatal

    async def stats(self) -> bytes:
        return _encoder.encode(
            ActorStats(
                engine=self.core.stats(),
                num_workers=len(self.executor.workers),
                worker_pids=list(self.executor.pids),
                num_worker_restarts=self._restarts,
                num_steps=self._steps,
                compiled_graph=self.executor.graph is not None,
                engine_pid=os.getpid(),
            )
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
        core = self.core
        while True:
            if not core.has_unfinished() and not core.scheduler.finished_ids:
                self._has_work.clear()
                await self._has_work.wait()
                continue
            so = core.scheduler.schedule()
            try:
                out = await self.executor.execute(so)
            except WorkerFailure as e:
                await self._recover(str(e))
                continue
            self._steps += 1
            self._publish(core.scheduler.update(so, out))

    async def _recover(self, error: str) -> None:
        log.error("%s; failing in-flight requests and rebuilding the workers", error)
        self._publish(self.core.fail_all(error))
        self._restarts += 1
        try:
            await self.executor.restart()
        except Exception as e:  # e.g. the cluster lost the resources: refuse work from now on
            self._fatal = f"the engine could not rebuild its workers: {type(e).__name__}: {e}"
            log.error(self._fatal)
            self._publish(self.core.fail_all(self._fatal))
            raise
