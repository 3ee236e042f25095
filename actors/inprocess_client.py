"""InProcessClient: an EngineClient whose engine steps in this process, without Ray.

    client = InProcessClient("SmolLM2-135M-Instruct")
    app = cadenza.gateway.app.build_app(client, "SmolLM2-135M-Instruct", GatewaySettings())

The EngineCore (scheduler, KV pool and model runner) is stepped by one task on the event
loop; each step's forward pass runs on its step thread, so the loop keeps serving sockets
meanwhile (torch releases the GIL). A lock keeps requests and aborts from touching the
scheduler while a step is in flight: they wait for the step's end, a few milliseconds.
For one machine and TP = PP = 1 (`cadenza serve --in-process`); the actor runtime (AsyncLLM)
adds worker isolation, restarts and parallelism.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from cadenza.actors.engine_core import EngineCore, model_thread
from cadenza.actors.stream_client import StreamingClient
from cadenza.config import DEFAULT_MODEL, EngineConfig
from cadenza.device import visible_gpus
from cadenza.messages import EngineRequest
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
        # All model work on one thread, the load included (engine_core.model_thread says why).
        loaded, self.core = EngineCore.load_on(model_thread(), self.config)
        self.tokenizer = loaded.tokenizer
        self.max_model_len = self.core.max_model_len
        self.request_limits = self.core.limits
        # Made on first use on each event loop (asyncio primitives belong to one loop).
        self._sync: tuple[asyncio.AbstractEventLoop, asyncio.Lock, asyncio.Event] | None = None
        self._steps = 0
        # One step at a time, off the loop: on the model thread itself, or, scheduling ahead,
        # on a thread of its own that waits there for each step's model work.
        ahead = self.config.schedules_ahead
        self._step_thread = ThreadPoolExecutor(1, "cadenza-engine") if ahead else self.core.step_thread

    async def stats(self) -> ServingStats:
        self._check_alive()
        return ServingStats(
            engine=self.core.stats(),
            num_workers=0,
            worker_pids=[],
            num_worker_restarts=0,
            num_steps=self._steps,
            compiled_graph=False,
            engine_pid=os.getpid(),
            executor="in_process",
        )

    async def check_health(self) -> None:
        self._check_alive()

    def shutdown(self) -> None:
        self._stop_pump()
        self._dead = "the engine was shut down"
        self._step_thread.shutdown(wait=False)
        self.core.step_thread.shutdown(wait=False)

    async def _submit(self, requests: list[EngineRequest]) -> None:
        async with self._loop_lock():
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
        async with self._loop_lock():
            outputs = self.core.abort(request_ids)
        self._route(time.monotonic(), outputs)
        self._wake()  # the runner hears of it with the next step and drops its copies

    async def _pull_outputs(self) -> None:
        core = self.core
        while True:
            if not core.has_unfinished() and not core.scheduler.finished_ids:
                self._work_event().clear()
                await self._work_event().wait()
                continue
            async with self._loop_lock():
                outputs = await self._step()
            self._route(time.monotonic(), outputs)

    async def _step(self) -> list:
        try:
            outputs = await asyncio.get_running_loop().run_in_executor(self._step_thread, self.core.step)
        except Exception as e:  # the scheduler itself broke: no request can be trusted to go on
            log.exception("the in-process engine failed")
            return self.core.fail_all(f"internal engine error: {type(e).__name__}: {e}")
        self._steps += 1
        return outputs

    def _loop_sync(self) -> tuple[asyncio.AbstractEventLoop, asyncio.Lock, asyncio.Event]:
        loop = asyncio.get_running_loop()
        if self._sync is None or self._sync[0] is not loop:
            self._sync = (loop, asyncio.Lock(), asyncio.Event())
        return self._sync

    def _loop_lock(self) -> asyncio.Lock:
        return self._loop_sync()[1]

    def _work_event(self) -> asyncio.Event:
        return self._loop_sync()[2]

    def _wake(self) -> None:
        self._work_event().set()
