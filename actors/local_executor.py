"""LocalExecutor: with TP = PP = 1 the engine actor runs the model runner in its own process
(an executor_base.WorkerExecutor, its one worker a plain object).

A step is then a function call on one dedicated thread, not an actor call: no msgpack of the
SchedulerOutput, no Ray hop out to a worker and none back (measured at batch 1 on 2 cores:
~5 ms of a ~15 ms step; `cadenza bench actors` shows the timeline). The step runs off the
event loop, so while the model computes step N + 1 the loop hands step N's outputs to the
client: the output path overlaps the next forward pass instead of preceding it.

The one thread does every model call (load, steps), so torch and OpenMP always see the same
caller. The price of sharing the engine's process: a crash inside the model (a segfault in a
kernel) takes the engine actor with it, which AsyncLLM reports as a dead engine; with
`executor="ray"` the worker is a separate actor the engine rebuilds instead.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import ray

from cadenza.actors.device_samples import PendingOutput
from cadenza.actors.executor import WorkerFailure, classify_step_error
from cadenza.actors.kv_connector.handoff import KVPull, KVShare
from cadenza.actors.worker import Worker
from cadenza.config import EngineConfig
from cadenza.messages import ModelRunnerOutput, SchedulerOutput, WorkerSpec

T = TypeVar("T")


class LocalExecutor:
    kind = "local"
    num_workers = 0  # the model runs in the engine actor's own process
    compiled_graph = False  # nothing crosses a process: there is no graph to compile

    def __init__(self, config: EngineConfig, num_blocks: int, eos_token_ids: tuple[int, ...]) -> None:
        if config.world_size != 1:
            raise ValueError("the local executor runs one worker: tensor_parallel_size = pipeline_parallel_size = 1")
        self.config = config
        self.spec = WorkerSpec(
            config=config,
            num_blocks=num_blocks,
            eos_token_ids=list(eos_token_ids),
            tp_rank=0,
            pp_rank=0,
            num_threads=config.worker_resources()[2],
        )
        self.worker: Worker | None = None
        self.pids: list[int] = []
        self.weight_bytes = 0
        self.num_blocks = num_blocks  # the pool once started (on CUDA, what the profile left)
        self._thread: ThreadPoolExecutor | None = None

    async def start(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cadenza-step")
        self.worker = await self._call(Worker, self.spec)
        await self._call(self.worker.load, None)
        self.num_blocks = self.worker.kv_blocks()
        await self._call(self.worker.allocate, self.num_blocks)
        self.pids = [os.getpid()]
        self.weight_bytes = self.worker.weight_bytes()

    def execute(self, so: SchedulerOutput) -> asyncio.Task[ModelRunnerOutput]:
        return asyncio.ensure_future(self._execute(so))

    async def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        try:
            result = await self._call(self.worker.launch, so)
            if isinstance(result, PendingOutput):  # scheduling ahead: the next step is launching
                result = result.result() if result.ready() else await asyncio.to_thread(result.result)
        except Exception as e:
            raise classify_step_error(e, tensor_parallel=False) from e
        if not isinstance(result, ModelRunnerOutput):  # the one worker is the last stage's driver
            raise WorkerFailure(f"the local worker answered {type(result).__name__}, not a ModelRunnerOutput")
        return result

    async def _call(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def read_kv(self, block_ids: list[int]) -> list[ray.ObjectRef]:
        """The KV connector's export: the blocks' bytes in the object store (one worker here).
        Off the step thread, so it does not wait for a step: the blocks are held (no step
        writes them) and a step only writes other blocks."""
        return [ray.put(await asyncio.to_thread(self.worker.read_kv, block_ids))]

    async def write_kv(self, block_ids: list[int], refs: list[ray.ObjectRef], positions: list[int]) -> int:
        """The KV connector's import, off the step thread likewise: the blocks written are
        fresh, held by no request until they are filed."""
        data = await refs[0]
        return await asyncio.to_thread(self.worker.write_kv, block_ids, data, positions)

    async def kv_shares(self) -> list[list[KVShare]] | None:
        """How a peer on this node opens the worker's caches (per worker, per cache set), or None."""
        shares = self.worker.kv_shares()
        return None if shares is None else [shares]

    async def pull_kv(self, block_ids: list[int], pull: KVPull, positions: list[int]) -> int:
        """The import of the `ipc` and `nixl` transports: blocks `positions` of the pull copied out of the
        exporter's shared caches, off the step thread as write_kv is."""
        if len(pull.shares) != 1:
            raise ValueError(f"{len(pull.shares)} KV shards for 1 worker: TP and PP must match")
        sources = [pull.block_ids[i] for i in positions]
        return await asyncio.to_thread(self.worker.pull_kv, block_ids, pull.shares[0], sources, pull.lease_end)

    def shutdown(self) -> None:
        self.worker = None  # the weights and KV go with the last reference
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
        self.pids = []

    async def restart(self) -> None:
        self.shutdown()
        await self.start()
