"""AsyncLLM: the streaming client of the actor runtime.

    llm = AsyncLLM("SmolLM2-135M-Instruct", tensor_parallel_size=2)
    async for delta in llm.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.outputs[0].text, end="")

It tokenizes and detokenizes here, in the caller's process (stream_client.StreamingClient);
the EngineActor schedules and its worker actors compute. One background task per event loop
pulls output batches from the engine and routes each delta to its request's queue. Leaving
the `async for` early or cancelling the task aborts the request, which frees its KV blocks.
"""

from __future__ import annotations

import time
from typing import Any

import ray

from cadenza.actors import codec
from cadenza.actors.engine_actor import EngineActor
from cadenza.actors.local_ray import ensure_ray
from cadenza.actors.stream_client import StreamingClient
from cadenza.config import DEFAULT_MODEL, EngineConfig
from cadenza.errors import EngineDeadError
from cadenza.messages import EngineRequest
from cadenza.models.loader import load_tokenizer, read_model
from cadenza.models.shard import stage_layers
from cadenza.models.tp import check_tp
from cadenza.stats import ServingStats

_RemoteEngine = ray.remote(EngineActor)
SHUTDOWN_TIMEOUT_S = 30.0


class AsyncLLM(StreamingClient):
    """Engine arguments are EngineConfig's (including tensor_parallel_size,
    pipeline_parallel_size, num_cpus_per_worker, num_gpus_per_worker)."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", seed: int = 0, **engine_args: Any) -> None:
        super().__init__()
        self.config = EngineConfig(model=model, dtype=dtype, seed=seed, **engine_args)
        path, self.model_config = read_model(model)
        check_tp(self.model_config, self.config.tensor_parallel_size)
        stage_layers(self.model_config.num_layers, self.config.pipeline_parallel_size, 0)
        self.tokenizer = load_tokenizer(path, self.model_config)
        ensure_ray(self.config.world_size)
        codec.register()
        self.engine = _RemoteEngine.options(num_cpus=0).remote(self.config)
        try:
            self.max_model_len: int = ray.get(self.engine.start.remote())
        except ray.exceptions.RayError as e:
            ray.kill(self.engine)
            raise RuntimeError(f"the engine failed to start: {e}") from e
        self.request_limits = self.config.request_limits(self.model_config.vocab_size, self.max_model_len)

    async def stats(self) -> ServingStats:
        self._check_alive()
        try:
            return await self.engine.stats.remote()
        except ray.exceptions.RayActorError as e:
            raise self._actor_died(e) from e

    async def check_health(self) -> None:
        """Raises when the engine cannot serve."""
        self._check_alive()
        try:
            problem = await self.engine.health.remote()
        except ray.exceptions.RayActorError as e:
            raise self._actor_died(e) from e
        if problem:
            raise EngineDeadError(problem)

    def shutdown(self) -> None:
        """Release the workers, their placement group and the engine actor."""
        self._stop_pump()
        try:
            ray.get(self.engine.shutdown.remote(), timeout=SHUTDOWN_TIMEOUT_S)
        except ray.exceptions.RayError:
            pass  # already dead: Ray reclaims what it owned
        ray.kill(self.engine)
        self._dead = "the engine was shut down"

    async def _submit(self, requests: list[EngineRequest]) -> None:
        for req in requests:
            try:
                error = await self.engine.add_request.remote(req)
            except ray.exceptions.RayActorError as e:
                raise self._actor_died(e) from e
            except ray.exceptions.RayTaskError as e:
                if (unreadable := codec.unreadable(e)) is None:
                    raise
                error = str(unreadable)  # not an EngineRequest: refused like any bad request
            if error is not None:
                raise ValueError(error)

    def _abort_soon(self, request_ids: list[str]) -> None:
        self.engine.abort.remote(request_ids)  # fire and forget

    async def _abort(self, request_ids: list[str]) -> None:
        await self.engine.abort.remote(request_ids)

    def _actor_died(self, error: BaseException) -> EngineDeadError:
        return self._mark_dead(f"the engine actor died: {type(error).__name__}")

    async def _pull_outputs(self) -> None:
        ack = 0
        while True:
            try:
                batch = await self.engine.get_outputs.remote(ack)
            except ray.exceptions.RayActorError as e:
                self._actor_died(e)
                return
            ack = batch.last
            self._route(time.monotonic(), batch.outputs)
