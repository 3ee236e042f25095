"""The engine's seams. One step loop (EngineCore.step_async) owns schedule -> execute -> update;
its owners (the engine actor, InProcessClient, LLM) do transport, recovery and stats through
the core's verbs, never through its scheduler or private state: read from the source with
ast, and the checker itself tested. The executors implement executor_base's Protocols with no
stand-ins. And the loop on a scripted executor, no model: pipelining to its depth, a step
that raises, a lost worker, a broken scheduler, a cancelled wait."""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Generator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cadenza import SamplingParams
from cadenza.actors.engine_core import EngineBroken, EngineCore, run_blocking
from cadenza.actors.executor_base import Executor, WorkerExecutor
from cadenza.actors.inprocess_executor import InProcessExecutor, ThreadCall
from cadenza.actors.step_errors import StepError, WorkerFailure
from cadenza.config import EngineConfig
from cadenza.messages import EngineOutput, EngineRequest, ModelRunnerOutput, SchedulerOutput
from cadenza.models.config import ModelConfig

ACTORS = Path(__file__).resolve().parents[2] / "actors"
# Where the scheduler may be reached: its own module, and the core that owns it.
SCHEDULER_OWNERS = {"engine_core.py", "scheduler.py"}
# The engine core's owners, which reach it through its public verbs only.
CORE_OWNERS = sorted({*ACTORS.glob("engine_*.py"), ACTORS / "inprocess_client.py"})


def scheduler_reach(source: str) -> list[int]:
    """Lines that reach a scheduler through another object (`core.scheduler`,
    `self.core.scheduler`); an object's own `self.scheduler` is its business."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and node.attr == "scheduler" and not _is_self(node.value)
    )


def private_reach(source: str) -> list[int]:
    """Lines that read another object's or module's `_private` attribute (dunders aside)."""
    return sorted(
        node.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not _is_self(node.value)
    )


def _is_self(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def test_the_checkers_find_what_they_should() -> None:
    assert scheduler_reach("self.core.scheduler.schedule()\ncore.scheduler\nself.scheduler.update()") == [1, 2]
    assert private_reach("self._x\ncls._y\nsuper()._z\nself.core._in_flight\nmod._helper()\nx.__class__") == [4, 5]


@pytest.mark.parametrize("path", sorted(ACTORS.glob("*.py")), ids=lambda p: p.name)
def test_only_the_core_reaches_its_scheduler(path: Path) -> None:
    if path.name in SCHEDULER_OWNERS:
        return
    assert scheduler_reach(path.read_text()) == [], f"{path.name} reaches through the core to its scheduler"


@pytest.mark.parametrize("path", CORE_OWNERS, ids=lambda p: p.name)
def test_the_cores_owners_touch_no_private_state_of_another(path: Path) -> None:
    assert private_reach(path.read_text()) == [], f"{path.name} reads another object's private attribute"


def test_the_executors_implement_the_protocols_without_stand_ins(tmp_path: Path) -> None:
    from cadenza.actors.executor import RayExecutor
    from cadenza.actors.local_executor import LocalExecutor

    config = EngineConfig(model=str(tmp_path), device="cpu")
    local, ray = LocalExecutor(config, 8, (0,)), RayExecutor(config, 8, (0,))
    assert isinstance(local, WorkerExecutor) and isinstance(ray, WorkerExecutor)
    assert not hasattr(local, "graph") and not hasattr(local, "workers")  # Ray's, and Ray's alone
    runner = SimpleNamespace(model=SimpleNamespace(weight_bytes=lambda: 5))
    in_process = InProcessExecutor(runner, None, blocking=True)
    assert isinstance(in_process, Executor) and not isinstance(in_process, WorkerExecutor)
    assert (local.kind, ray.kind, in_process.kind) == ("local", "ray", "in_process")


# ---- the loop on a scripted executor --------------------------------------------------------

MODEL = ModelConfig("llama", 100, 8, 16, 1, 1, 1, 8, 1e-5, 1e4, 64, False)
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
TIMING = [1.0, 2.0, 3.0]  # started, forwarded, sampled: the driver's stamps


class Scripted:
    """An executor that answers every scheduled request with token 7, unless told to raise.
    Its calls never suspend, so the core steps under run_blocking as under LLM."""

    kind, num_workers, pids, compiled_graph, weight_bytes = "scripted", 0, [], False, 0

    def __init__(self) -> None:
        self.started: list[SchedulerOutput] = []
        self.in_flight_when_awaited: list[int] = []  # steps started, not yet awaited, at each wait
        self.raises: dict[int, BaseException] = {}  # the n-th step (from 1) raises this

    def execute(self, so: SchedulerOutput) -> Answer:
        self.started.append(so)
        return Answer(self, so, self.raises.get(len(self.started)))

    def shutdown(self) -> None:
        pass


class Answer:
    def __init__(self, executor: Scripted, so: SchedulerOutput, error: BaseException | None) -> None:
        self.executor, self.so, self.error = executor, so, error
        self.cancelled = False

    def __await__(self) -> Generator[Any, None, ModelRunnerOutput]:
        awaited = self.executor.in_flight_when_awaited
        awaited.append(len(self.executor.started) - len(awaited))
        yield from ()
        if self.error is not None:
            raise self.error
        sampled = {rid: [7] for rid in self.so.num_scheduled_tokens}
        return ModelRunnerOutput(sampled=sampled, timing=list(TIMING) if sampled else [])

    def cancel(self) -> bool:
        self.cancelled = True
        return True


def _core(tmp_path: Path, executor: Executor, ahead: bool = True, **kwargs: Any) -> EngineCore:  # noqa: ANN401
    config = EngineConfig(
        model=str(tmp_path), device="cpu", num_blocks=32, block_size=4, async_scheduling=ahead, **kwargs
    )
    return EngineCore(config, MODEL, 64, (0,), executor)


def _add(core: EngineCore, rid: str, params: SamplingParams = GREEDY) -> None:
    core.add_request(EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=params))


def _run(core: EngineCore) -> list[EngineOutput]:
    outputs = []
    while core.has_work():
        outputs += core.step()
    return outputs


@pytest.mark.parametrize(("ahead", "depth"), [(True, 2), (False, 1)])
def test_steps_are_pipelined_to_the_depth_and_numbered(tmp_path: Path, ahead: bool, depth: int) -> None:
    executor = Scripted()
    core = _core(tmp_path, executor, ahead)
    _add(core, "a")
    result = run_blocking(core.step_async())
    assert executor.in_flight_when_awaited == [depth]  # the next step was started before the first was awaited
    assert [(o.request_id, o.new_token_ids, o.step) for o in result.outputs] == [("a", [7], 1)]
    assert result.timing.step == 1 and result.timing.started == TIMING[0]
    outputs = _run(core)
    assert [o.new_token_ids for o in outputs] == [[7], [7]] and outputs[-1].finish_reason == "length"
    assert max(executor.in_flight_when_awaited) == depth
    core.scheduler.check_invariants()
    stats = core.serving_stats(num_worker_restarts=2)
    assert (stats.executor, stats.num_worker_restarts, stats.num_steps) == ("scripted", 2, core.num_steps)
    assert stats.engine.kv_cache.num_free_blocks == 32


def test_a_step_that_raises_fails_its_requests_alone(tmp_path: Path) -> None:
    executor = Scripted()
    core = _core(tmp_path, executor, ahead=False, max_num_seqs=1)
    executor.raises[1] = StepError("IndexError: a shape this request triggers")
    _add(core, "poison")
    _add(core, "good")
    outputs = _run(core)
    ended = {o.request_id: (o.finish_reason, o.error) for o in outputs if o.finish_reason}
    assert ended["poison"] == ("error", "the request failed during a step: IndexError: a shape this request triggers")
    assert ended["good"] == ("length", None)
    core.scheduler.check_invariants()


def test_a_lost_worker_goes_to_the_owner_who_drops_the_pipeline(tmp_path: Path) -> None:
    executor = Scripted()
    core = _core(tmp_path, executor)
    executor.raises[1] = WorkerFailure("a worker died")
    _add(core, "a")
    with pytest.raises(WorkerFailure):
        core.step()
    assert core.has_work()  # the failed step and the one behind it are still in line
    second = executor.started[1]
    asyncio.run(core.cancel_in_flight())
    outputs = core.reset_after_worker_loss("a worker died")
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error")]
    assert not core.has_work() and second.num_scheduled_tokens == {"a": 1}
    core.scheduler.check_invariants()


def test_a_broken_scheduler_raises_and_its_failures_are_handed_over_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = _core(tmp_path, Scripted())
    _add(core, "a")

    def broken() -> SchedulerOutput:
        raise RuntimeError("a scheduler bug")

    def inconsistent() -> None:
        raise AssertionError("block tables and pool disagree")

    monkeypatch.setattr(core.scheduler, "schedule", broken)
    monkeypatch.setattr(core.scheduler, "check_invariants", inconsistent)
    with pytest.raises(EngineBroken, match="a scheduler bug; then AssertionError: block tables and pool disagree"):
        core.step()
    (failed,) = core.fail_all("the engine stopped")  # what the owner does next: the first failure comes first
    assert failed.request_id == "a" and failed.error.startswith("internal engine error while scheduling")


def test_a_scheduling_error_fails_every_request_and_the_engine_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    core = _core(tmp_path, Scripted())
    _add(core, "a")
    schedule = core.scheduler.schedule

    def broken() -> SchedulerOutput:
        raise RuntimeError("a scheduler bug")

    monkeypatch.setattr(core.scheduler, "schedule", broken)
    (failed,) = core.step()
    assert failed.finish_reason == "error" and "while scheduling: RuntimeError" in failed.error
    monkeypatch.setattr(core.scheduler, "schedule", schedule)
    _add(core, "b")
    assert _run(core)[-1].finish_reason == "length"


def test_a_cancelled_wait_leaves_the_step_first_in_line(tmp_path: Path) -> None:
    """An owner cancelled mid-step (an event loop closing) must not lose the step: the
    scheduler counted its tokens, so the next step() applies its output."""

    class OnAThread(Scripted):  # InProcessClient's calls: a thread's future, awaited on the loop
        def execute(self, so: SchedulerOutput) -> ThreadCall:
            self.started.append(so)
            self.future: Future[ModelRunnerOutput] = Future()
            return ThreadCall(self.future, blocking=False)

    executor = OnAThread()
    core = _core(tmp_path, executor, ahead=False)
    _add(core, "a")

    async def run() -> list[EngineOutput]:
        step = asyncio.ensure_future(core.step_async())
        await asyncio.sleep(0)
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
        assert len(executor.started) == 1
        executor.future.set_result(ModelRunnerOutput(sampled={"a": [7]}))
        return (await core.step_async()).outputs

    (out,) = asyncio.run(run())
    assert out.new_token_ids == [7] and len(executor.started) == 1


def test_run_blocking_refuses_a_step_that_would_suspend() -> None:
    async def suspends() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="blocking executor"):
        run_blocking(suspends())
