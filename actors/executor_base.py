"""Executor: where the engine core's steps run, documented once.

The core plans a step (SchedulerOutput), hands it to its executor and applies the
ModelRunnerOutput that comes back (engine_core.EngineCore.step_async). Three implementations:

    InProcessExecutor  actors/inprocess_executor.py  the runner in the caller's process (LLM, InProcessClient)
    LocalExecutor      actors/local_executor.py      a Worker on the engine actor's step thread (TP = PP = 1)
    RayExecutor        actors/executor.py            tp * pp worker actors

`execute` starts a step and returns at once with a StepCall that the core awaits later, so
with async scheduling step N + 1 is planned and started while step N computes (vLLM v1's
batch queue). A call ends in the step's output or raises one of the two failures of
actors/step_errors.py: StepError (the step's requests fail, all else goes on) or
WorkerFailure (the workers' KV is lost: the owner rebuilds them). Anything else is a bug.

Torch-free, like step_errors: the engine actor's module names these types in a process (the
gateway's) that never loads the model code.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from cadenza.messages import ModelRunnerOutput, SchedulerOutput


class StepCall(Protocol):
    """A started step. Awaited for its output (once; again only after a cancelled wait);
    cancel() abandons it, its output no longer wanted (the KV it was planned on is gone)."""

    def __await__(self) -> Generator[Any, None, ModelRunnerOutput]: ...

    def cancel(self) -> bool: ...


@runtime_checkable
class Executor(Protocol):
    """What the engine core needs: steps, and the facts ServingStats reports."""

    @property
    def kind(self) -> str:
        """ServingStats.executor: "in_process", "local" or "ray"."""
        ...

    @property
    def num_workers(self) -> int:
        """Worker actors (0 where the model runs in the engine's own process)."""
        ...

    @property
    def pids(self) -> list[int]:
        """The processes that hold the model, the engine's own excepted where it runs in the caller's."""
        ...

    @property
    def compiled_graph(self) -> bool:
        """Whether steps run as a Ray Compiled Graph."""
        ...

    @property
    def weight_bytes(self) -> int:
        """The resident weights, every shard's together."""
        ...

    def execute(self, so: SchedulerOutput) -> StepCall:
        """Start the step now; its output is awaited through the call."""
        ...

    def shutdown(self) -> None:
        """Release the model, its threads and its workers."""
        ...


@runtime_checkable
class WorkerExecutor(Executor, Protocol):
    """An executor the engine actor owns: it places and loads its workers, and rebuilds them
    after a WorkerFailure."""

    @property
    def num_blocks(self) -> int:
        """The KV pool every worker allocated once started (on CUDA, what profiling left)."""
        ...

    async def start(self) -> None:
        """Place and load the workers and allocate their KV pool."""
        ...

    async def restart(self) -> None:
        """New workers for lost ones, over the pool the engine already hands out."""
        ...
