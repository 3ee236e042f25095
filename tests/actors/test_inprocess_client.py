"""InProcessClient: the EngineClient whose engine steps in this process (no Ray). Its
streams equal the offline engine's, cancelled streams free their blocks, and a refused
request fails alone."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from cadenza_testkit.waiting import until

from cadenza import InProcessClient, SamplingParams
from cadenza.errors import EngineDeadError
from cadenza.models.loader import DEFAULT_MODEL
from cadenza.structured_outputs import StructuredOutputs

NUM_BLOCKS = 512


@pytest.fixture(scope="module")
def client() -> Iterator[InProcessClient]:
    engine = InProcessClient(DEFAULT_MODEL, num_blocks=NUM_BLOCKS)
    yield engine
    engine.shutdown()


async def _text(client: InProcessClient, prompt: str, params: SamplingParams) -> tuple[list[int], str]:
    tokens, text = [], ""
    async for delta in client.generate(prompt, params):
        tokens += delta.outputs[0].token_ids
        text += delta.outputs[0].text
    return tokens, text


async def _cancelled(client: InProcessClient, prompt: str) -> int:
    seen = 0
    async for _ in client.generate(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)):
        seen += 1
        if seen == 3:
            break
    return seen


@pytest.mark.slow
def test_streams_equal_offline_and_cancelled_ones_free_their_blocks(client: InProcessClient, smollm) -> None:
    prompts = [f"Write one sentence about the number {i}." for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20)
    reference = smollm.generate(prompts, params, use_tqdm=False)

    async def run() -> tuple[list, list[int]]:
        streams = [_text(client, p, params) for p in prompts]
        cancels = [_cancelled(client, p) for p in prompts[:2]]
        results = await asyncio.gather(*streams, *cancels)

        async def idle() -> bool:  # the aborts land with the next lock turn
            engine = (await client.stats()).engine
            return engine.kv_cache.num_free_blocks == NUM_BLOCKS and engine.num_running == 0

        await until(idle, "the cancelled streams' blocks are free")
        return results[: len(prompts)], results[len(prompts) :]

    streamed, cancelled = asyncio.run(run())
    for (tokens, text), ref in zip(streamed, reference, strict=True):
        assert tokens == ref.outputs[0].token_ids
        assert text == ref.outputs[0].text
    assert cancelled == [3, 3]
    stats = asyncio.run(client.stats())
    assert stats.num_workers == 0 and stats.num_steps > 0
    assert stats.engine.kv_cache.num_free_blocks == NUM_BLOCKS
    assert stats.engine.num_running == stats.engine.num_waiting == 0
    steps = stats.engine.step_tokens  # every scheduled token counted once, in some step
    assert steps.num_steps == sum(steps.counts) > 0 and steps.total_tokens >= steps.num_steps


@pytest.mark.slow
def test_a_refused_request_fails_alone(client: InProcessClient, smollm) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    (reference,) = smollm.generate(["Name a colour."], params, use_tqdm=False)
    vocab = client.request_limits.vocab_size

    async def run() -> tuple[str, tuple[list[int], str]]:
        good = asyncio.ensure_future(_text(client, "Name a colour.", params))
        with pytest.raises(ValueError, match="prompt token ids must be in") as refused:
            await _text(client, {"prompt_token_ids": [1, vocab + 5]}, params)
        return str(refused.value), await good

    message, (tokens, _) = asyncio.run(run())
    assert str(vocab) in message
    assert tokens == reference.outputs[0].token_ids


def test_a_grammar_that_cannot_compile_is_refused_before_any_work(client: InProcessClient) -> None:
    """A direct client's (not only the gateway's) invalid grammar is the caller's ValueError,
    named, before the request reaches the engine."""
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="direct-client-(b"))

    async def run() -> str:
        with pytest.raises(ValueError, match="^structured_outputs: invalid regex") as refused:
            await _text(client, "hi", params)
        return str(refused.value)

    asyncio.run(run())  # before: RequestFailedError from the runner, once the request was queued


def test_parallelism_needs_the_actor_runtime() -> None:
    with pytest.raises(ValueError, match="tensor / pipeline parallelism needs AsyncLLM"):
        InProcessClient(DEFAULT_MODEL, tensor_parallel_size=2)


@pytest.mark.slow
def test_a_shut_down_client_says_so(smollm_path) -> None:
    engine = InProcessClient(DEFAULT_MODEL, num_blocks=64)
    engine.shutdown()

    async def run() -> None:
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.check_health()

    asyncio.run(run())
