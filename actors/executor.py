"""RayExecutor: the engine actor's handle on its worker actors (an executor_base.WorkerExecutor).

tp * pp workers in one placement group. A step sends the same SchedulerOutput to every
worker; stage s + 1 gets stage s's hidden states over torch.distributed (actors/stage_link.py)
and, through the executor, a HiddenStates naming their shape. The last stage's TP rank 0
(the driver) returns the ModelRunnerOutput.
Worker calls take and return these Structs; Ray sends them as msgpack (cadenza.actors.codec).

Steps run as plain actor calls chained by object refs, or as a Ray Compiled Graph (channels
set up once: ~0.8 ms a round trip for two stages instead of ~3.6 ms, measured here) when
EngineConfig.compiled_graph says so and Ray can build one. Its channels poll, so on a small
CPU host it takes a core from the model; it is the default on CUDA only.

Every step races a death watch: one never-returning call per worker in its own concurrency
group, which Ray fails the moment that worker dies. Neither transport alone reports a death
promptly every time: a Compiled Graph can leave its output future pending for good once its
monitor has torn the graph down, and a surviving TP rank waits out distributed_timeout_s in
its collective.
"""

from __future__ import annotations

import asyncio
import logging

import ray
from ray.dag import InputNode, MultiOutputNode
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cadenza.actors.kv_connector.handoff import KVPull, KVShare
from cadenza.actors.step_errors import StepError, WorkerFailure  # noqa: F401 - raised here, caught there
from cadenza.actors.worker import StageOutput, Worker
from cadenza.config import EngineConfig
from cadenza.messages import ModelRunnerOutput, SchedulerOutput, WorkerSpec

# How long to wait for the cluster to grant the workers' resources before giving up.
PLACEMENT_TIMEOUT_S = 60.0

# Worker.watch runs in its own group, off the thread that executes steps.
_WATCH_GROUP = "watch"
_RemoteWorker = ray.remote(concurrency_groups={_WATCH_GROUP: 1})(Worker)
log = logging.getLogger(__name__)


# Errors after which a live worker still cannot be trusted: the device context or a
# collective is broken, so it is rebuilt like a dead one.
_FATAL_MARKERS = ("CUDA", "NCCL", "cuDNN", "Gloo", "gloo", "ProcessGroup", "distributed")


class RayExecutor:
    kind = "ray"

    def __init__(self, config: EngineConfig, num_blocks: int, eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self.graph: ray.dag.CompiledDAG | None = None
        self.num_blocks = num_blocks
        self._pool_agreed = False
        self.eos_token_ids = list(eos_token_ids)
        self.stages: list[list[ray.actor.ActorHandle]] = []  # [pp][tp]
        self.pids: list[int] = []
        self.weight_bytes = 0  # all shards' together
        self.pg: PlacementGroup | None = None
        self.death_watch: list[asyncio.Future] = []

    async def start(self) -> None:
        cfg = self.config
        cpus, gpus, threads = cfg.worker_resources()
        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        self.pg = placement_group([bundle] * cfg.world_size, strategy="PACK")
        try:
            await asyncio.wait_for(self.pg.ready(), PLACEMENT_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"the Ray cluster could not place {cfg.world_size} workers of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:.0f} s; available: {ray.available_resources()}"
            ) from None
        self.stages = [
            [self._spawn(tp, pp, threads, cpus, gpus) for tp in range(cfg.tensor_parallel_size)]
            for pp in range(cfg.pipeline_parallel_size)
        ]
        url = await self._rendezvous() if cfg.world_size > 1 else None
        self.pids = await asyncio.gather(*(w.load.remote(url) for w in self.workers))
        self.num_blocks = self._agreed_pool(min(await asyncio.gather(*(w.kv_blocks.remote() for w in self.workers))))
        await asyncio.gather(*(w.allocate.remote(self.num_blocks) for w in self.workers))
        self.weight_bytes = sum(await asyncio.gather(*(w.weight_bytes.remote() for w in self.workers)))
        self.death_watch = [asyncio.ensure_future(self._watch(w)) for w in self.workers]
        if self.config.compiled_graph:
            self.graph = self._compile()

    def _agreed_pool(self, fits: int) -> int:
        """One pool for every rank: the smallest any has room for (on CUDA each profiled its
        own). Rebuilt workers keep the engine's pool, whose block tables are already in use."""
        if not self._pool_agreed:
            self._pool_agreed = True
            return fits
        if fits < self.num_blocks:
            raise RuntimeError(
                f"rebuilt workers have room for {fits} KV blocks; the engine's pool is {self.num_blocks}"
            )
        return self.num_blocks

    def _compile(self) -> ray.dag.CompiledDAG | None:
        try:
            with InputNode() as scheduler_output:
                nodes = [w.execute.bind(scheduler_output) for w in self.stages[0]]
                for stage in self.stages[1:]:
                    nodes = [w.execute.bind(scheduler_output, n) for w, n in zip(stage, nodes, strict=True)]
                return MultiOutputNode(nodes).experimental_compile(enable_asyncio=True)
        except Exception as e:  # an older Ray, or a transport it cannot set up here
            log.warning("Ray Compiled Graph unavailable (%s); using actor calls", e)
            return None

    def _spawn(self, tp: int, pp: int, threads: int, cpus: float, gpus: float) -> ray.actor.ActorHandle:
        spec = WorkerSpec(
            config=self.config,
            num_blocks=self.num_blocks,
            eos_token_ids=self.eos_token_ids,
            tp_rank=tp,
            pp_rank=pp,
            num_threads=threads,
        )
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=pp * self.config.tensor_parallel_size + tp
        )
        return _RemoteWorker.options(num_cpus=cpus, num_gpus=gpus, scheduling_strategy=strategy).remote(spec)

    @staticmethod
    async def _watch(worker: ray.actor.ActorHandle) -> BaseException:
        """Resolves only when the worker dies (or is killed by shutdown), with the reason."""
        try:
            await worker.watch.options(concurrency_group=_WATCH_GROUP).remote()
        except Exception as e:
            return e
        return RuntimeError("Worker.watch returned")

    async def _rendezvous(self) -> str:
        nodes = set(await asyncio.gather(*(w.node_id.remote() for w in self.workers)))
        return await self.workers[0].rendezvous.remote(len(nodes) == 1)

    @property
    def workers(self) -> list[ray.actor.ActorHandle]:
        return [w for stage in self.stages for w in stage]

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def compiled_graph(self) -> bool:
        return self.graph is not None

    def execute(self, so: SchedulerOutput) -> asyncio.Task[ModelRunnerOutput]:
        return asyncio.ensure_future(self._execute(so))

    async def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        step = asyncio.ensure_future(self._graph_step(so) if self.graph is not None else self._call_step(so))
        done, _ = await asyncio.wait([step, *self.death_watch], return_when=asyncio.FIRST_COMPLETED)
        if step in done:
            return step.result()
        step.cancel()
        e = next(f for f in self.death_watch if f.done()).result()
        raise WorkerFailure(f"a worker died during a step: {type(e).__name__}: {_first_line(e)}")

    async def _graph_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            results = await asyncio.gather(*await self.graph.execute_async(so))
        except Exception as e:  # a dead actor cancels the whole graph at once
            raise WorkerFailure(f"a worker failed during a step: {type(e).__name__}: {_first_line(e)}") from e
        # A torn-down graph hands back its channel error as a value instead of raising it.
        for r in results:
            if isinstance(r, BaseException):
                raise WorkerFailure(f"a worker failed during a step: {type(r).__name__}: {_first_line(r)}")
        return _driver_output(results[0])

    async def _call_step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        if not so.total_num_scheduled_tokens:  # bookkeeping only (finished ids): no hidden states
            refs = [w.execute.remote(so) for w in self.workers]
        else:
            refs = [w.execute.remote(so) for w in self.stages[0]]
            for stage in self.stages[1:]:
                # Stage outputs are identical across TP ranks (all-reduced); rank i feeds rank i.
                refs += [w.execute.remote(so, ref) for w, ref in zip(stage, refs[-len(stage) :], strict=True)]
        try:
            results = await asyncio.gather(*refs)
        except ray.exceptions.RayTaskError as e:
            raise self._classify(e) from e
        except ray.exceptions.RayError as e:
            raise WorkerFailure(f"a worker failed during a step: {type(e).__name__}: {_first_line(e)}") from e
        return _driver_output(results[-len(self.stages[-1])])  # the last stage's rank 0

    def _classify(self, e: ray.exceptions.RayTaskError) -> RuntimeError:
        """An exception raised by Worker.execute in a live actor."""
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
        return classify_step_error(cause, self.config.tensor_parallel_size > 1)

    async def read_kv(self, block_ids: list[int]) -> list[ray.ObjectRef]:
        """The KV connector's export: each worker's share of the blocks (its heads, its stage's
        layers) stays in the object store; only the references come back. A worker's calls run
        one at a time, so a read never overlaps its step."""
        refs = [w.read_kv.remote(block_ids) for w in self.workers]
        await asyncio.to_thread(ray.wait, refs, num_returns=len(refs), fetch_local=False)
        return refs

    async def write_kv(self, block_ids: list[int], refs: list[ray.ObjectRef], positions: list[int]) -> int:
        """The KV connector's import: worker i reads the exporter's worker i's array (the same
        shard of the same layers: equal TP and PP on both sides)."""
        if len(refs) != len(self.workers):
            raise ValueError(f"{len(refs)} KV shards for {len(self.workers)} workers: TP and PP must match")
        calls = [w.write_kv.remote(block_ids, ref, positions) for w, ref in zip(self.workers, refs, strict=True)]
        return sum(await asyncio.gather(*calls))

    async def kv_shares(self) -> list[list[KVShare]] | None:
        """How a peer on the workers' node opens their caches (per worker, per cache set), or None."""
        shares = await asyncio.gather(*[w.kv_shares.remote() for w in self.workers])
        return None if None in shares else shares

    async def pull_kv(self, block_ids: list[int], pull: KVPull, positions: list[int]) -> int:
        """The import of the `ipc` and `nixl` transports: worker i copies blocks `positions` of the pull out of
        the exporter's worker i's shared caches (the same shard)."""
        if len(pull.shares) != len(self.workers):
            raise ValueError(f"{len(pull.shares)} KV shards for {len(self.workers)} workers: TP and PP must match")
        sources = [pull.block_ids[i] for i in positions]
        pairs = zip(self.workers, pull.shares, strict=True)
        calls = [w.pull_kv.remote(block_ids, s, sources, pull.lease_end) for w, s in pairs]
        return sum(await asyncio.gather(*calls))

    def shutdown(self) -> None:
        # Kill first: a graph's teardown waits for every worker's loop, and a survivor may sit
        # in a collective for distributed_timeout_s.
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        for watch in self.death_watch:
            watch.cancel()
        self.death_watch = []
        if self.graph is not None:
            try:
                self.graph.teardown()
            except Exception as e:  # the workers are gone already
                log.warning("compiled graph teardown: %s", e)
            self.graph = None
        self.stages = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    async def restart(self) -> None:
        self.shutdown()
        await self.start()


def classify_step_error(cause: BaseException, tensor_parallel: bool) -> RuntimeError:
    """What a step's exception means. With tensor parallelism the peers may sit in a collective
    the failed rank never joined, so any error there is a worker fault; so is a broken device."""
    text = f"{type(cause).__name__}: {_first_line(cause)}"
    if tensor_parallel or any(m in text for m in _FATAL_MARKERS):
        return WorkerFailure(f"a worker failed during a step: {text}")
    return StepError(text)


def _driver_output(result: StageOutput) -> ModelRunnerOutput:
    """What the driver (the last stage's TP rank 0) answered, as the step's output."""
    return ModelRunnerOutput.empty() if result is None else result


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]
