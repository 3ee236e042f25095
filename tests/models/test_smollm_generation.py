"""The real SmolLM2-135M-Instruct: greedy generation against HF, seeds, stop strings, n."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from cadenza_testkit.hf_oracle import hf_greedy_choices

from cadenza import LLM, SamplingParams
from cadenza.models.loader import DEFAULT_MODEL

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers.",
    "How do I reverse a list in Python?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a name for a friendly robot.",
]
STEPS = 64


@pytest.fixture(scope="module")
def chat_prompts(smollm) -> list[list[int]]:
    tok = smollm.get_tokenizer()
    return [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def hf_greedy(hf_smollm) -> Callable[[list[int], list[int]], list[int]]:
    """HF's greedy pick at each position of a continuation (teacher-forced, one forward per
    distinct sequence), EOS banned as min_new_tokens bans it."""
    eos = hf_smollm.generation_config.eos_token_id
    banned = tuple(eos) if isinstance(eos, list) else (eos,)
    cache: dict[tuple[int, ...], list[int]] = {}

    def picks(prompt: list[int], tokens: list[int]) -> list[int]:
        key = (*prompt, -1, *tokens)
        if key not in cache:
            cache[key] = hf_greedy_choices(hf_smollm, prompt, tokens, banned)
        return cache[key]

    return picks


GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, min_tokens=STEPS)


def test_greedy_one_at_a_time_matches_hf(smollm, chat_prompts, hf_greedy) -> None:
    for ids in chat_prompts:
        out = smollm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == STEPS
        assert list(out.token_ids) == hf_greedy(ids, list(out.token_ids))


@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_continuous_batch_matches_hf(chat_prompts, hf_greedy, block_size: int) -> None:
    llm = LLM(DEFAULT_MODEL, block_size=block_size, max_num_batched_tokens=48, num_blocks=512)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in chat_prompts], GREEDY, use_tqdm=False)
    for ids, out in zip(chat_prompts, outs, strict=True):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == STEPS
        assert tokens == hf_greedy(ids, tokens)


def test_prefix_cache_512_token_prefix(smollm) -> None:
    tok = smollm.get_tokenizer()
    words = " ".join(f"item{i}" for i in range(400))
    prefix = tok.encode(words)[:512]
    assert len(prefix) == 512
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    before = smollm.stats().kv_cache.hits
    smollm.generate({"prompt_token_ids": prefix + tok.encode(" first")}, params, use_tqdm=False)
    second = smollm.generate({"prompt_token_ids": prefix + tok.encode(" second")}, params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 512
    assert smollm.stats().kv_cache.hits - before == 512
    ids = second.prompt_token_ids
    uncached = smollm.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, prompt_logprobs=0),
        use_tqdm=False,
    )[0]  # prompt_logprobs bypasses the cache
    assert uncached.num_cached_tokens == 0
    assert uncached.outputs[0].token_ids == second.outputs[0].token_ids


def test_seeded_sample_same_alone_and_in_batch(smollm) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24)
    prompt = "Tell me a story about a dragon."
    alone = smollm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [f"Question {i}: what is {i} + {i}?" for i in range(7)]
    batch = smollm.generate(
        others[:3] + [prompt] + others[3:],
        [SamplingParams(temperature=1.0, max_tokens=24)] * 3
        + [params]
        + [SamplingParams(temperature=1.0, max_tokens=24)] * 4,
        use_tqdm=False,
    )
    assert batch[3].outputs[0].token_ids == alone


def test_stop_string_across_tokens(smollm) -> None:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    full = smollm.generate("The quick brown fox", params, use_tqdm=False)[0].outputs[0]
    tok = smollm.get_tokenizer()
    pieces = [tok.decode(full.token_ids[: i + 1]) for i in range(len(full.token_ids))]
    # A stop string that starts inside one token and ends inside a later one.
    stop = full.text[len(pieces[4]) - 1 : len(pieces[8]) - 1]
    assert len(stop) > 3
    out = smollm.generate(
        "The quick brown fox",
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == full.text[: full.text.find(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert smollm.stats().num_running == 0


def test_logprobs_and_n(smollm) -> None:
    out = smollm.generate("Hello", SamplingParams(n=2, seed=3, max_tokens=5, logprobs=3), use_tqdm=False)[0]
    assert len(out.outputs) == 2
    for seq in out.outputs:
        assert len(seq.logprobs) == len(seq.token_ids)
        for token, position in zip(seq.token_ids, seq.logprobs, strict=True):
            assert token in position and len(position) <= 4
            assert position[token].logprob <= 0
        assert seq.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(seq.token_ids, seq.logprobs)))


def test_chat_and_stream(smollm) -> None:
    params = SamplingParams(temperature=0, max_tokens=20)
    chat = smollm.chat([{"role": "user", "content": "Say hello."}], params)[0].outputs[0].text
    tok = smollm.get_tokenizer()
    prompt = {"prompt": tok.apply_chat_template([{"role": "user", "content": "Say hello."}]), "chat": True}
    assert "".join(smollm.stream(prompt, params)) == chat
