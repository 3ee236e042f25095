"""InProcessExecutor: the model runner in the caller's own process, for LLM and InProcessClient.

A step runs on the caller's thread when LLM steps one at a time (the thread that loaded the
model: engine_core.model_thread says why that matters), else on the model thread, where the
next step computes while the engine applies the last. The executor is made blocking or not,
once: LLM's calls block when awaited, so its engine core steps with no event loop
(engine_core.run_blocking); InProcessClient's suspend, so its event loop serves sockets
while the model computes (torch releases the GIL).

Every exception from the runner is a StepError: in this process there are no workers to
rebuild, and the step's requests fail alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from cadenza.actors.device_samples import PendingOutput
from cadenza.actors.model_runner import ModelRunner
from cadenza.actors.step_errors import StepError
from cadenza.messages import ModelRunnerOutput, SchedulerOutput

# A step's output as the runner hands it over: scheduling ahead, its samples may still be
# on their way to the host.
RunnerResult = ModelRunnerOutput | PendingOutput


class InProcessExecutor:
    kind = "in_process"
    num_workers = 0
    compiled_graph = False

    def __init__(self, runner: ModelRunner, thread: ThreadPoolExecutor | None, blocking: bool) -> None:
        if thread is None and not blocking:
            raise ValueError("steps awaited on an event loop must run off it: give the model thread")
        self.runner = runner  # replaceable (tests swap in a fresh KV); read at every step
        self.thread = thread
        self.blocking = blocking

    @property
    def pids(self) -> list[int]:
        return []  # no process beside the caller's

    @property
    def weight_bytes(self) -> int:
        return self.runner.model.weight_bytes()

    def execute(self, so: SchedulerOutput) -> ThreadCall:
        if self.thread is None:  # one step at a time on the caller's thread: run it now
            done: Future[RunnerResult] = Future()
            try:
                done.set_result(self._run(so))
            except StepError as e:
                done.set_exception(e)
            return ThreadCall(done, blocking=True)
        return ThreadCall(self.thread.submit(self._run, so), self.blocking)

    def _run(self, so: SchedulerOutput) -> RunnerResult:
        try:
            return self.runner.execute(so)
        except Exception as e:
            raise StepError(f"{type(e).__name__}: {e}") from e

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=False)


class ThreadCall:
    """A step on the model thread (or run already). Blocking, awaiting it waits right there,
    never suspending, which is what lets run_blocking drive the core's coroutine; else it
    suspends its event loop's task. The thread's future is never cancelled by a cancelled wait:
    a step queued behind another must still reach the runner, whose state assumes it."""

    def __init__(self, future: Future[RunnerResult], blocking: bool) -> None:
        self.future = future
        self.blocking = blocking

    def __await__(self) -> Generator[Any, None, ModelRunnerOutput]:
        if not self.blocking:
            result = yield from asyncio.shield(asyncio.wrap_future(self.future)).__await__()
            return (yield from off_loop_landed(result).__await__())
        return landed_here(self.future.result())

    def cancel(self) -> bool:
        return self.future.cancel()


def landed_here(result: RunnerResult) -> ModelRunnerOutput:
    """The output on the host, waiting for its samples' copy on this thread if need be."""
    if not isinstance(result, PendingOutput):
        return result
    try:
        return result.result()
    except Exception as e:  # reading the samples back is part of the step
        raise StepError(f"{type(e).__name__}: {e}") from e


async def off_loop_landed(result: RunnerResult) -> ModelRunnerOutput:
    """landed_here without blocking the event loop: a copy still in flight is waited for on
    a thread of its own, while the model thread already launches the next step."""
    if isinstance(result, PendingOutput) and not result.ready():
        return await asyncio.to_thread(landed_here, result)
    return landed_here(result)
