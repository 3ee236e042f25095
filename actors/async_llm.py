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

import asyncio
import logging
import time
from contextlib import suppress
from typing import Any

import msgspec
import ray

from cadenza.actors import codec
from cadenza.actors.engine_actor import EngineActor
from cadenza.actors.kv_connector.handoff import KVHandoff, KVImport
from cadenza.actors.local_ray import ensure_ray
from cadenza.actors.output_stream import stream_batches
from cadenza.actors.stream_client import StreamingClient
from cadenza.config import DEFAULT_MODEL, EngineConfig
from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.messages import EngineRequest, OutputBatch, Refusal
from cadenza.models.generation_config import sampling_defaults
from cadenza.models.model_files import load_tokenizer, read_model
from cadenza.models.partition import check_tp, expert_slice, stage_layers
from cadenza.stats import ServingStats

_RemoteEngine = ray.remote(EngineActor)
log = logging.getLogger(__name__)
SHUTDOWN_TIMEOUT_S = 30.0


class AsyncLLM(StreamingClient):
    """Engine arguments are EngineConfig's (including tensor_parallel_size,
    pipeline_parallel_size, num_cpus_per_worker, num_gpus_per_worker).

    ray_address: the Ray cluster to run the engine in ("host:port" of its GCS, "auto" for the
    one `ray start` began on this host, "ray://host:port"); None: $RAY_ADDRESS, else a private
    instance on loopback, started here (even when another Ray instance runs on this host). A
    cluster named but not answering is a ConnectionError within seconds. A process that
    already called ray.init (the test suite, a Ray Serve replica) keeps its Ray and
    ray_address is not read (actors/local_ray.ensure_ray). `ray_instance` says which it was."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str = "auto",
        seed: int = 0,
        ray_address: str | None = None,
        **engine_args: Any,
    ) -> None:
        super().__init__()
        config = EngineConfig(model=model, dtype=dtype, seed=seed, **engine_args)
        path, self.model_config = read_model(model)
        check_tp(self.model_config, config.tensor_parallel_size)
        if config.enable_expert_parallel and self.model_config.num_experts:
            expert_slice(self.model_config.num_experts, config.tensor_parallel_size, 0)
        stage_layers(self.model_config.num_layers, config.pipeline_parallel_size, 0)
        self.tokenizer = load_tokenizer(path, self.model_config)
        self.sampling_defaults = sampling_defaults(model, config.generation_config)
        self.ray_instance = ensure_ray(config.world_size, ray_address)
        # The workers (or the local engine actor) take the GPUs, not this process: the cluster's count.
        self.config = config.placed(int(ray.cluster_resources().get("GPU", 0)), "the Ray cluster")
        codec.register()
        self.output_transport = "actor calls"  # "socket" while outputs stream over one
        self.engine = _new_engine(self.config)
        try:
            self.max_model_len: int = ray.get(self.engine.start.remote())
            # Known before any hand-over: asking first would delay a prompt's first export past
            # its request (actors/disaggregated.py relies on the export arriving first).
            places = ray.get(self.engine.kv_places.remote()) if self.config.shares_kv else None
        except ray.exceptions.RayError as e:
            ray.kill(self.engine)
            raise RuntimeError(f"the engine failed to start: {e}") from e
        self._kv_places: tuple[Any, list[str] | None] = (self.engine, places)  # (engine actor asked, its answer)
        self.request_limits = self.config.request_limits(self.model_config.vocab_size, self.max_model_len)
        self._engine_restarts = 0
        self._restarting = False  # a replacement engine is starting

    @property
    def num_engine_restarts(self) -> int:
        """Engine actors replaced so far: a new one starts with an empty prefix cache."""
        return self._engine_restarts

    async def stats(self) -> ServingStats:
        self._check_alive()
        stats = await self._call("stats")
        stats.num_engine_restarts = self._engine_restarts
        return stats

    async def check_health(self) -> None:
        """Raises when the engine cannot serve. A replacement that is starting counts as healthy:
        a health check (Serve's) must not replace the replica while it recovers by itself."""
        self._check_alive()
        if self._restarting:
            return
        problem = await self._call("health")
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

    async def export_kv(
        self,
        token_ids: list[int],
        cache_salt: str | None = None,
        skip: int = 0,
        wait_s: float = 0.0,
        pull_at: list[str] | None = None,
    ) -> tuple[KVHandoff, list[Any]]:
        """The cached blocks of token_ids' prefix after the first `skip`, for another engine
        (actors/kv_connector/; leased, for one whose workers are at pull_at, its kv_places, to
        copy out of this one's shared caches: then release_kv when done); with wait_s, once a
        prefill step has cached one more."""
        self._check_alive()
        return await self._call("export_kv", token_ids, cache_salt, skip, wait_s, pull_at)

    async def release_kv(self, lease: int) -> None:
        """A pull of export_kv's leased blocks is over. Best effort: an engine that died took
        its leases with it, and one that does not hear of it ends the lease at kv_lease_s."""
        with suppress(EngineDeadError, ray.exceptions.RayError):
            await self._call("release_kv", lease)

    async def kv_places(self) -> list[str] | None:
        """Where this engine's workers are (node, and GPU on CUDA), for an exporter to lease it
        blocks to copy out of the exporter's shared caches; None: its caches are not shared.
        Asked at start, and once more of a replacement engine actor."""
        self._check_alive()
        engine = self.engine
        if self._kv_places[0] is not engine:
            self._kv_places = (engine, await self._call("kv_places"))
        return self._kv_places[1]

    async def import_kv(self, handoff: KVHandoff, refs: list[Any]) -> KVImport:
        """Another engine's exported blocks into this engine's prefix cache."""
        self._check_alive()
        return await self._call("import_kv", handoff, refs)

    async def _submit(self, requests: list[EngineRequest]) -> None:
        for req in requests:
            try:
                refusal: Refusal | None = await self._call("add_request", req)
            except ray.exceptions.RayTaskError as e:
                if (unreadable := codec.unreadable(e)) is None:
                    raise
                refusal = Refusal("invalid", str(unreadable))  # not an EngineRequest: a bad request
            if refusal is not None:
                raise (EngineDeadError if refusal.kind == "dead" else ValueError)(refusal.message)

    def _abort_soon(self, request_ids: list[str]) -> None:
        self.engine.abort.remote(request_ids)  # fire and forget

    async def _abort(self, request_ids: list[str]) -> None:
        await self.engine.abort.remote(request_ids)

    async def _call(self, method: str, *args: object) -> Any:
        """One call to the engine actor; its death is told apart from a failure of the call."""
        engine = self.engine
        try:
            return await getattr(engine, method).remote(*args)
        except ray.exceptions.RayActorError as e:
            raise self._actor_died(e, engine) from e

    def _actor_died(self, error: BaseException, engine: ray.actor.ActorHandle) -> EngineDeadError:
        """`engine` is gone. While it may still be replaced (or already was: the pump, parked
        on it, sees the death too and replaces it), this call fails alone; after that, for good."""
        retry = f"the engine actor died ({type(error).__name__}); it is being restarted, retry the request"
        if self._dead:
            return EngineDeadError(self._dead)
        if engine is not self.engine or self._restarting:
            return EngineDeadError(retry)
        if self._engine_restarts < self.config.max_engine_restarts:
            self._ensure_pump()
            return EngineDeadError(retry)
        return self._mark_dead(f"the engine actor died: {type(error).__name__}")

    async def _replace_engine(self, error: BaseException) -> bool:
        """A dead engine actor (under the local executor, a crash in the model) is replaced, up
        to max_engine_restarts times: the requests in flight fail with the reason (their KV and
        queue died with it), later ones run on the new engine. False: it stays dead."""
        if self._dead or self._engine_restarts >= self.config.max_engine_restarts:
            return False
        self._engine_restarts += 1
        reason = f"the engine actor died ({type(error).__name__}); it was restarted, retry the request"
        log.error("%s (restart %d of %d)", reason, self._engine_restarts, self.config.max_engine_restarts)
        failed = RequestFailedError(reason)
        for queue in set(self._queues.values()):
            queue.put_nowait(failed)
        ray.kill(self.engine)  # whatever is left of it
        self.engine, self._restarting = _new_engine(self.config), True
        try:
            await self.engine.start.remote()
        except ray.exceptions.RayError as e:
            log.error("the replacement engine failed to start: %s", e)
            return False
        finally:
            self._restarting = False
        return True

    async def _pull_outputs(self) -> None:
        """Route every batch the engine publishes: streamed over its socket when it runs on
        this node, else (or once the socket breaks) by actor calls, which also tell a dead
        engine (replaced here) from a broken socket."""
        ack = 0
        while True:
            ack = await self._stream_outputs(ack)
            try:
                batch = await self.engine.get_outputs.remote(ack)
            except ray.exceptions.RayActorError as e:
                if not await self._replace_engine(e):
                    self._mark_dead(f"the engine actor died: {type(e).__name__}")
                    return
                ack = 0
                continue
            ack = self._take(batch)

    async def _stream_outputs(self, ack: int) -> int:
        """Batches from the engine's socket until it breaks; the last routed batch's number."""
        try:
            node, path = await self.engine.output_socket.remote()
        except ray.exceptions.RayError:
            return ack  # the actor call that follows says what happened
        if node != ray.get_runtime_context().get_node_id():
            return ack
        self.output_transport = "socket"
        try:
            async for batch, routed in stream_batches(path, ack):
                ack = self._take(batch)
                routed()
        except (OSError, asyncio.IncompleteReadError, ValueError, msgspec.DecodeError) as e:
            log.debug("the output socket closed (%s); falling back to actor calls", e)
        self.output_transport = "actor calls"
        return ack

    def _take(self, batch: OutputBatch) -> int:
        arrival = time.monotonic()
        if self.recorder is not None:
            self.recorder.on_batch(batch.timings, arrival)
        self._route(arrival, batch.outputs)
        return batch.last


def _new_engine(config: EngineConfig) -> ray.actor.ActorHandle:
    return _RemoteEngine.options(**engine_resources(config)).remote(config)


def engine_resources(config: EngineConfig) -> dict[str, float]:
    """The engine actor's Ray resources: none of its own beside worker actors; a worker's
    (CPUs, and the GPU on CUDA) when the model runs in its process (executor "local")."""
    if config.executor_kind != "local":
        return {"num_cpus": 0}
    cpus, gpus, _ = config.worker_resources()
    return {"num_cpus": cpus, "num_gpus": gpus}
