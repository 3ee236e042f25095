"""InProcessClient: an EngineClient whose engine steps in this process, without Ray.

    client = InProcessClient("SmolLM2-135M-Instruct")
    app = cadenza.gateway.app.build_app(client, "SmolLM2-135M-Instruct", GatewaySettings())

The EngineCore (scheduler, KV pool, and the model runner through an InProcessExecutor) is
stepped by one task on the event loop: the core plans and applies steps there, and each
step's forward pass runs on the model thread, so the loop keeps serving sockets meanwhile
(torch releases the GIL). Requests and aborts reach the scheduler on the same loop, between
the core's awaits, as they reach the engine actor's. For one machine and TP = PP = 1
(`cadenza serve --in-process`); the actor runtime (AsyncLLM) adds worker isolation, restarts
and parallelism.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import torch

from cadenza.actors.engine_core import EngineCore, model_thread
from cadenza.actors.stream_client import StreamingClient
from cadenza.config import DEFAULT_MODEL, EngineConfig
from cadenza.device import visible_gpus
from cadenza.messages import EngineOutput, EngineRequest
from cadenza.models.generation_config import sampling_defaults
from cadenza.stats import ServingStats

log = logging.getLogger(__name__)


class InProcessClient(StreamingClient):
    """Engine arguments are EngineConfig's; tensor and pipeline parallelism need AsyncLLM."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", seed: int = 0, **engine_args: Any) -> None:
        super().__init__()
        self.config = EngineConfig(model=model, dtype=dtype, seed=seed, **engine_args).placed(visible_gpus())
        if self.config.world_size != 1:
            raise ValueError("the in-process engine runs one worker; tensor / pipeline parallelism needs AsyncLLM")
        torch.manual_seed(seed)
        # All model work on one thread, the load included (engine_core.model_thread says why);
        # the steps are awaited on the event loop, never blocking it.
        loaded, self.core = EngineCore.load_on(model_thread(), self.config, blocking=False)
        self.tokenizer = loaded.tokenizer
        self.sampling_defaults = sampling_defaults(model, self.config.generation_config)
        self.max_model_len = self.core.max_model_len
        self.request_limits = self.core.limits
        # Made on first use on each event loop (asyncio primitives belong to one loop).
        self._work: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None

    async def stats(self) -> ServingStats:
        self._check_alive()
        return self.core.serving_stats()

    async def check_health(self) -> None:
        self._check_alive()

    def shutdown(self) -> None:
        self._stop_pump()
        self._dead = "the engine was shut down"
        self.core.executor.shutdown()

    async def _submit(self, requests: list[EngineRequest]) -> None:
        for req in requests:
            self.core.add_request(req)  # a refusal raises ValueError with the reason
        self._wake()

    def _abort_soon(self, request_ids: list[str]) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a stream closed outside the loop (at exit): no step is in flight
            self.core.abort(request_ids)
            return
        loop.create_task(self._abort(request_ids))

    async def _abort(self, request_ids: list[str]) -> None:
        self._route(time.monotonic(), self.core.abort(request_ids))
        self._wake()  # the runner hears of it with the next step and drops its copies

    async def _pull_outputs(self) -> None:
        while True:
            if not self.core.has_work():
                self._work_event().clear()
                await self._work_event().wait()
                continue
            outputs = await self._step()
            self._route(time.monotonic(), outputs)

    async def _step(self) -> list[EngineOutput]:
        try:
            return (await self.core.step_async()).outputs
        except Exception as e:  # the engine's own state broke (EngineBroken): no request can be trusted to go on
            log.exception("the in-process engine failed")
            return self.core.fail_all(f"internal engine error: {type(e).__name__}: {e}")

    def _work_event(self) -> asyncio.Event:
        loop = asyncio.get_running_loop()
        if self._work is None or self._work[0] is not loop:
            self._work = (loop, asyncio.Event())
        return self._work[1]

    def _wake(self) -> None:
        self._work_event().set()
