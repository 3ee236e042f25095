"""Speculative decoding through AsyncLLM: the stream shows what each step accepted, pacing
turns bursts into one token per delta, and the text stays exactly the greedy text."""

from __future__ import annotations

import asyncio

import pytest

from cadenza import LLM, AsyncLLM, SamplingParams
from cadenza.models.loader import DEFAULT_MODEL
from cadenza.outputs import RequestOutput

# Input-grounded: the reply copies the prompt, so prompt-lookup drafts get accepted.
SENTENCE = "the quick brown fox jumps over the lazy dog."
MESSAGES = [{"role": "user", "content": f"Repeat exactly: {SENTENCE} {SENTENCE}"}]
GREEDY = SamplingParams(temperature=0, max_tokens=40)


@pytest.fixture(scope="module")
def ngram_llm(ray_cluster) -> AsyncLLM:
    llm = AsyncLLM(DEFAULT_MODEL, num_blocks=512, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def reference(smollm) -> RequestOutput:
    """The same greedy reply without speculation, in process."""
    return smollm.chat(MESSAGES, GREEDY)[0]


def _stream(llm: AsyncLLM, prompt: dict, params: SamplingParams, pace: bool = False) -> list[RequestOutput]:
    async def run() -> list[RequestOutput]:
        return [delta async for delta in llm.generate(prompt, params, pace=pace)]

    return asyncio.run(run())


def _chat_prompt(llm: AsyncLLM) -> dict:
    return {"prompt": llm.get_tokenizer().apply_chat_template(MESSAGES, True), "chat": True}


def _joined(deltas: list[RequestOutput]) -> tuple[list[int], str]:
    return [t for d in deltas for t in d.outputs[0].token_ids], "".join(d.outputs[0].text for d in deltas)


@pytest.mark.slow
def test_ngram_stream_matches_greedy_and_reports_acceptance(ngram_llm: AsyncLLM, reference: RequestOutput) -> None:
    deltas = _stream(ngram_llm, _chat_prompt(ngram_llm), GREEDY)
    tokens, text = _joined(deltas)
    assert tokens == reference.outputs[0].token_ids and text == reference.outputs[0].text
    accepted = [d.outputs[0].num_accepted_tokens for d in deltas]
    assert max(accepted) > 0 and max(len(d.outputs[0].token_ids) for d in deltas) > 1
    for d in deltas[:-1]:  # accepted drafts plus the target's own token (the last step may be cut short)
        assert d.outputs[0].num_accepted_tokens == max(len(d.outputs[0].token_ids) - 1, 0)
    final = deltas[-1].metrics[0]
    assert final.num_accepted_tokens == sum(accepted) and 0 < final.num_drafts <= final.num_draft_tokens
    assert 0 < final.acceptance_rate <= 1
    spec = asyncio.run(ngram_llm.stats()).engine.spec_decode
    assert spec is not None and spec.num_accepted_tokens >= final.num_accepted_tokens
    assert sum(spec.accepted_per_position) == spec.num_accepted_tokens


@pytest.mark.slow
def test_paced_stream_is_one_token_per_delta_with_the_same_text(ngram_llm: AsyncLLM, reference: RequestOutput) -> None:
    deltas = _stream(ngram_llm, _chat_prompt(ngram_llm), GREEDY, pace=True)
    tokens, text = _joined(deltas)
    assert tokens == reference.outputs[0].token_ids and text == reference.outputs[0].text
    assert all(len(d.outputs[0].token_ids) == 1 for d in deltas)
    accepted = [d.outputs[0].num_accepted_tokens for d in deltas]
    assert set(accepted) <= {0, 1} and sum(accepted) == deltas[-1].metrics[0].num_accepted_tokens > 0
    assert [d.outputs[0].finish_reason is not None for d in deltas].count(True) == 1


@pytest.mark.slow
def test_draft_model_with_tensor_parallel_matches_greedy(ray_cluster, tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    prompts = [{"prompt_token_ids": [(7 * i + j) % 150 + 3 for j in range(5 + 9 * i)]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(str(path), num_blocks=256).generate(prompts, params)]
    draft = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    llm = AsyncLLM(str(path), tensor_parallel_size=2, num_blocks=256, speculative_config=draft)

    async def run() -> list[list[RequestOutput]]:
        async def one(prompt: dict) -> list[RequestOutput]:
            return [delta async for delta in llm.generate(prompt, params)]

        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        streams = asyncio.run(run())
    finally:
        llm.shutdown()
    assert [_joined(deltas)[0] for deltas in streams] == expected
    offline = LLM(str(path), num_blocks=256, speculative_config=draft).generate(prompts, params)
    for out, deltas in zip(offline, streams):  # LLM.generate's output holds the sequence's total
        assert out.outputs[0].num_accepted_tokens == out.metrics[0].num_accepted_tokens > 0
        assert out.outputs[0].token_ids == _joined(deltas)[0]
    # The draft is the target itself: the driver's drafts are (nearly) always accepted.
    assert all(deltas[-1].metrics[0].num_accepted_tokens > 0 for deltas in streams)
    assert max(len(d.outputs[0].token_ids) for deltas in streams for d in deltas) > 1
