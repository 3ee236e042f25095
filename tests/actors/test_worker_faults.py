"""Faults through the actor runtime (Ray, tiny model): a worker SIGKILLed mid-stream, poison
requests beside a live stream, exact-id abort, and an engine loop that breaks."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
from cadenza_testkit.faulty_engine import BREAK_FOR_GOOD, BREAK_SCHEDULER, SchedulerBreaksEngine
from cadenza_testkit.waiting import until

from cadenza import LLM, AsyncLLM, SamplingParams
from cadenza.actors import async_llm as async_llm_module
from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.messages import EngineRequest

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
PREFIX = list(range(1, 49))  # three 16-token blocks


async def _collect(llm: AsyncLLM, ids: list[int], params: SamplingParams, **kw) -> tuple[list[int], object]:  # noqa: ANN003
    tokens, last = [], None
    async for delta in llm.generate({"prompt_token_ids": ids}, params, **kw):
        tokens += delta.outputs[0].token_ids
        last = delta
    return tokens, last


async def _slow_reader(llm: AsyncLLM, ids: list[int], started: asyncio.Event) -> BaseException | None:
    try:
        async for _ in llm.generate({"prompt_token_ids": ids}, LONG):
            started.set()
            await asyncio.sleep(0.01)  # still streaming when the worker dies
    except RequestFailedError as e:
        return e
    return None


def _reference(path: str, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    llm = LLM(path, num_blocks=256, enable_prefix_caching=False)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_sigkilled_worker_fails_running_keeps_waiting_and_serves_no_stale_prefix(ray_cluster, tiny_model) -> None:
    """Running requests fail with the reason; requests that were only queued run after the
    rebuild to their reference output; a prompt sharing a prefix cached before the crash gets
    its reference greedy output (before the fix it read the rebuilt worker's zeroed KV)."""
    path = str(tiny_model("llama_gqa_tied")[0])
    queued = [[100 + i, 101, 102, 103 + i] for i in range(2)]
    shared = PREFIX + [60, 61]
    expected_queued = _reference(path, queued, GREEDY)
    (expected_shared,) = _reference(path, [shared], GREEDY)
    llm = AsyncLLM(path, num_blocks=256, max_num_seqs=2, executor="ray")  # a worker actor to kill

    async def run() -> None:
        await _collect(llm, PREFIX + [50], GREEDY)  # the prefix is now cached
        pid = (await llm.stats()).worker_pids[0]
        started = asyncio.Event()
        running = [asyncio.ensure_future(_slow_reader(llm, [7 + i, 8, 9], started)) for i in range(2)]
        await started.wait()
        waiting = [asyncio.ensure_future(_collect(llm, q, GREEDY)) for q in queued]

        async def both_wait() -> bool:
            return (await llm.stats()).engine.num_waiting == 2

        await until(both_wait, "both requests wait behind the running two")
        os.kill(pid, signal.SIGKILL)
        errors = await asyncio.wait_for(asyncio.gather(*running), timeout=60)  # a hang guard
        assert all(isinstance(e, RequestFailedError) and "died" in str(e) for e in errors)
        results = await asyncio.wait_for(asyncio.gather(*waiting), timeout=120)
        assert [tokens for tokens, _ in results] == expected_queued
        tokens, last = await _collect(llm, shared, GREEDY)
        assert tokens == expected_shared and last.num_cached_tokens == 0
        stats = await llm.stats()
        assert stats.num_worker_restarts == 1 and stats.engine.kv_cache.num_free_blocks == 256

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tiny_async(ray_cluster, tiny_model) -> AsyncLLM:
    llm = AsyncLLM(str(tiny_model("llama_gqa_tied")[0]), num_blocks=256)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize(
    "ids,params,message",
    [
        ([1, 2], SamplingParams(top_k=10**6), "top_k"),
        ([1, 2], SamplingParams(logprobs=10**6), "max_logprobs"),
        ([1, 2], SamplingParams(prompt_logprobs=10**6), "max_logprobs"),
        ([1, 10**6], SamplingParams(), "prompt token ids"),
        ([1, 2], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ],
)
def test_poison_requests_fail_alone_beside_a_live_stream(
    tiny_async: AsyncLLM, tiny_model, ids: list[int], params: SamplingParams, message: str
) -> None:
    (expected,) = _reference(str(tiny_model("llama_gqa_tied")[0]), [[3, 4, 5]], GREEDY)
    restarts = None

    async def run() -> None:
        nonlocal restarts
        restarts = (await tiny_async.stats()).num_worker_restarts
        live = asyncio.ensure_future(_collect(tiny_async, [3, 4, 5], GREEDY))
        with pytest.raises(ValueError, match=message):
            await _collect(tiny_async, ids, params)
        # The engine refuses it too, for a client that skips the client-side check.
        raw = EngineRequest(request_id="raw-poison", prompt_token_ids=ids, sampling_params=params)
        refused = await tiny_async.engine.add_request.remote(raw)
        assert refused is not None and refused.kind == "invalid" and message in refused.message
        tokens, last = await live
        assert tokens == expected and last.outputs[0].finish_reason == "length"
        assert (await tiny_async.stats()).num_worker_restarts == restarts

    asyncio.run(run())


async def _collect_signalling(llm: AsyncLLM, ids: list[int], params: SamplingParams, started: asyncio.Event, **kw):  # noqa: ANN003, ANN202
    """_collect that sets `started` at the first delta: abort then, not after a fixed sleep
    (a fast machine finishes a 400-token request in well under a second)."""
    tokens, last = [], None
    async for delta in llm.generate({"prompt_token_ids": ids}, params, **kw):
        tokens += delta.outputs[0].token_ids
        last = delta
        started.set()
    return tokens, last


def test_abort_takes_exactly_the_named_request(tiny_async: AsyncLLM) -> None:
    async def run() -> None:
        started = asyncio.Event()
        x = asyncio.ensure_future(_collect_signalling(tiny_async, [5, 6], LONG, started, request_id="x"))
        x1 = asyncio.ensure_future(_collect(tiny_async, [5, 7], GREEDY, request_id="x-1"))
        await asyncio.wait_for(started.wait(), timeout=60)
        await tiny_async.abort("x")
        (_, last_x), (tokens_x1, last_x1) = await asyncio.wait_for(asyncio.gather(x, x1), timeout=60)
        assert last_x.outputs[0].finish_reason == "abort"
        assert last_x1.outputs[0].finish_reason == "length" and len(tokens_x1) == GREEDY.max_tokens

    asyncio.run(run())


def test_an_engine_loop_error_fails_requests_and_a_broken_engine_says_why(
    ray_cluster, tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    monkeypatch.setattr(async_llm_module, "_RemoteEngine", ray.remote(SchedulerBreaksEngine))
    llm = AsyncLLM(str(tiny_model("llama_gqa_tied")[0]), num_blocks=64)

    async def run() -> None:
        with pytest.raises(RequestFailedError, match="internal engine error while scheduling"):
            await _collect(llm, [1, 2, 3], GREEDY, request_id=BREAK_SCHEDULER)
        tokens, _ = await _collect(llm, [1, 2, 3], GREEDY)  # the engine goes on
        assert len(tokens) == GREEDY.max_tokens
        await llm.check_health()
        with pytest.raises(RequestFailedError, match="internal engine error while scheduling"):
            await _collect(llm, [1, 2, 3], GREEDY, request_id=BREAK_FOR_GOOD)
        with pytest.raises(EngineDeadError, match="block tables and pool disagree"):
            await llm.check_health()  # what /health turns into a 503 with the reason
        # Refused at once, never left waiting, and as the engine's fault (a 503), not the
        # request's (the refusal crosses the actor boundary typed: messages.Refusal).
        with pytest.raises(EngineDeadError, match="internal engine error"):
            await _collect(llm, [1, 2, 3], GREEDY)

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
