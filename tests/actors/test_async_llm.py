"""AsyncLLM over the engine and worker actors: streaming, cancellation, faults, bad input."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from cadenza import AsyncLLM, SamplingParams
from cadenza.errors import EngineDeadError, RequestFailedError
from cadenza.models.loader import DEFAULT_MODEL

NUM_BLOCKS = 1024


@pytest.fixture(scope="module")
def async_smollm(ray_cluster) -> AsyncLLM:
    llm = AsyncLLM(DEFAULT_MODEL, num_blocks=NUM_BLOCKS)
    yield llm
    llm.shutdown()


def _prompts(n: int) -> list[str]:
    topics = ["the sea", "robots", "bread", "winter", "music", "trains", "cats", "the moon"]
    return [f"Write one sentence about {topics[i % len(topics)]} and the number {i}." for i in range(n)]


async def _collect(llm: AsyncLLM, prompt: str, params: SamplingParams) -> tuple[list[int], str, str | None]:
    tokens, text, reason = [], "", None
    async for delta in llm.generate(prompt, params):
        out = delta.outputs[0]
        tokens += out.token_ids
        text += out.text
        reason = out.finish_reason
    return tokens, text, reason


@pytest.mark.slow
def test_32_streams_match_offline_and_8_cancelled_free_their_blocks(async_smollm: AsyncLLM, smollm) -> None:
    prompts = _prompts(32)
    params = SamplingParams(temperature=0, max_tokens=24)
    reference = smollm.generate(prompts, params, use_tqdm=False)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def cancelled_by_task(prompt: str) -> int:
        seen = 0
        async for _ in async_smollm.generate(prompt, long):
            seen += 1
            if seen == 3:
                asyncio.current_task().cancel()
        return seen

    async def cancelled_by_break(prompt: str) -> int:
        seen = 0
        async for _ in async_smollm.generate(prompt, long):
            seen += 1
            if seen == 3:
                break
        return seen

    async def run() -> tuple[list, list]:
        idle = (await async_smollm.stats()).engine.kv_cache.num_free_blocks
        assert idle == NUM_BLOCKS
        full = asyncio.gather(*(_collect(async_smollm, p, params) for p in prompts))
        quitters = [asyncio.ensure_future(cancelled_by_task(p)) for p in prompts[:4]]
        quitters += [asyncio.ensure_future(cancelled_by_break(p)) for p in prompts[4:8]]
        results = await full
        outcomes = await asyncio.gather(*quitters, return_exceptions=True)
        deadline = time.monotonic() + 10
        while (stats := await async_smollm.stats()).engine.num_running or stats.engine.num_waiting:
            assert time.monotonic() < deadline, "aborted requests still hold the engine"
            await asyncio.sleep(0.05)
        return results, outcomes + [stats]

    results, (*outcomes, stats) = asyncio.run(run())
    assert async_smollm.output_transport == "socket"  # same node: outputs streamed, not fetched per step
    for (tokens, text, reason), ref in zip(results, reference, strict=True):
        assert tokens == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
        assert reason == ref.outputs[0].finish_reason
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes[:4])
    assert outcomes[4:] == [3] * 4
    assert stats.engine.kv_cache.num_free_blocks == NUM_BLOCKS  # every block back
    assert stats.engine.num_running == stats.engine.num_waiting == 0


def test_bad_input_is_refused_and_others_carry_on(async_smollm: AsyncLLM) -> None:
    async def run() -> None:
        good = asyncio.ensure_future(_collect(async_smollm, "Say hi.", SamplingParams(temperature=0, max_tokens=8)))
        with pytest.raises(ValueError, match="max_model_len"):
            await _collect(async_smollm, "x", SamplingParams(max_tokens=async_smollm.max_model_len + 1))
        with pytest.raises(ValueError, match="empty"):
            await _collect(async_smollm, {"prompt_token_ids": []}, SamplingParams())
        with pytest.raises(ValueError, match=r"\[0, 49152\)"):
            await _collect(async_smollm, {"prompt_token_ids": [10**6]}, SamplingParams())
        tokens, _, reason = await good
        assert len(tokens) == 8 and reason == "length"

    asyncio.run(run())


@pytest.mark.parametrize("compiled", [False, True], ids=["actor_calls", "compiled_graph"])
def test_killed_worker_fails_in_flight_requests_then_recovers(ray_cluster, tiny_model, compiled: bool) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = AsyncLLM(str(path), num_blocks=256, tensor_parallel_size=2, use_compiled_graph=compiled)
    long = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)

    async def in_flight(started: asyncio.Event) -> BaseException | None:
        try:
            async for _ in llm.generate({"prompt_token_ids": [5, 6, 7]}, long):
                started.set()
                await asyncio.sleep(0.01)  # slow reader: still streaming when the worker dies
        except RequestFailedError as e:
            return e
        return None

    async def run() -> None:
        started = asyncio.Event()
        tasks = [asyncio.ensure_future(in_flight(started)) for _ in range(4)]
        await started.wait()
        ray.kill((await llm.engine.workers.remote())[1])
        # A guard against a hang, not a speed check: the death watch reports within a step,
        # while the survivor's collective would wait out distributed_timeout_s (60 s).
        errors = await asyncio.wait_for(asyncio.gather(*tasks), timeout=45)
        assert all(isinstance(e, RequestFailedError) and "worker" in str(e) for e in errors)
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        async for delta in llm.generate({"prompt_token_ids": [1, 2, 3]}, params):
            last = delta
        assert last.finished and last.outputs[0].finish_reason == "length"
        stats = await llm.stats()
        assert stats.num_worker_restarts == 1 and stats.num_workers == 2 and stats.compiled_graph == compiled

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()


def test_dead_engine_is_a_clear_error_and_a_new_client_works(ray_cluster, tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = AsyncLLM(str(path), num_blocks=64, max_engine_restarts=0)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run() -> None:
        stream = llm.generate({"prompt_token_ids": [4, 5]}, params)
        await stream.__anext__()
        ray.kill(llm.engine)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await llm.generate({"prompt_token_ids": [4, 5]}, params).__anext__()
        with pytest.raises(EngineDeadError):
            await llm.check_health()  # what the gateway's /health turns into a 503

    asyncio.run(run())
    again = AsyncLLM(str(path), num_blocks=64)
    try:

        async def one() -> int:
            n = 0
            async for delta in again.generate({"prompt_token_ids": [4, 5]}, SamplingParams(max_tokens=3)):
                n += len(delta.outputs[0].token_ids)
            return n

        assert asyncio.run(one()) == 3
    finally:
        again.shutdown()


def test_a_crashed_engine_is_replaced_and_serves_again(ray_cluster, tiny_model) -> None:
    """Under the local executor a crash in the model (here SIGKILL) takes the engine actor:
    the stream in flight fails with the reason, the next request runs on a new engine."""
    path, _ = tiny_model("llama_gqa_tied")
    llm = AsyncLLM(str(path), num_blocks=64, max_engine_restarts=1)
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def run() -> None:
        before = await llm.stats()
        assert before.executor == "local" and before.num_workers == 0
        stream = llm.generate({"prompt_token_ids": [4, 5]}, params)
        await stream.__anext__()
        os.kill(before.engine_pid, signal.SIGKILL)
        with pytest.raises(RequestFailedError, match="restarted"):
            async for _ in stream:
                pass
        for _ in range(600):  # the replacement loads the model; /health says 503 meanwhile
            try:
                await llm.check_health()
                break
            except EngineDeadError:
                await asyncio.sleep(0.1)
        tokens = []
        async for delta in llm.generate({"prompt_token_ids": [4, 5]}, SamplingParams(temperature=0, max_tokens=5)):
            tokens += delta.outputs[0].token_ids
        assert len(tokens) == 5
        after = await llm.stats()
        assert after.num_engine_restarts == 1 and after.engine_pid != before.engine_pid

    try:
        asyncio.run(run())
    finally:
        llm.shutdown()
