"""Speculative decoding in the engine: greedy output identical with and without it (n-gram
and draft model; alone, batched, with chunked prefill, prefix caching and preemption), no
leaked KV blocks, the batch-size switch, per-request k, and seeded sampling independent of
the batch."""

from __future__ import annotations

from pathlib import Path

import pytest

from cadenza import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _draft(path: Path, k: int = 3, **extra: object) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": k, **extra}


def _repetitive_prompts() -> list[dict]:
    """Token patterns that repeat, so n-gram lookup finds matches, and one that does not."""
    motif = [(7 * i) % 150 + 3 for i in range(12)]
    return [
        {"prompt_token_ids": motif * 4},
        {"prompt_token_ids": list(range(5, 45))},
        {"prompt_token_ids": motif[:6] * 5 + [99]},
        {"prompt_token_ids": [11, 12, 13] * 9},
    ]


def _tokens(llm: LLM, prompts: list, params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def _assert_pool_clean(llm: LLM) -> None:
    """Every block back in the pool (cached ones included) and the pool's own invariants hold."""
    llm.engine.scheduler.check_invariants()
    stats = llm.engine.stats().kv_cache
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identical_alone_and_batched(tiny_model, method: str) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    spec = NGRAM if method == "ngram" else _draft(path, draft_num_layers=1)
    prompts = _repetitive_prompts()
    base = LLM(str(path), num_blocks=128, block_size=8)
    llm = LLM(str(path), num_blocks=128, block_size=8, speculative_config=spec)
    expected = _tokens(base, prompts)
    assert [_tokens(llm, [p])[0] for p in prompts] == expected  # alone
    assert _tokens(llm, prompts) == expected  # one continuous batch
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens <= stats.num_draft_tokens
    _assert_pool_clean(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_identical_with_chunked_prefill_prefix_hits_and_preemption(tiny_model, method: str) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    spec = NGRAM if method == "ngram" else _draft(path)  # the target as its own draft: all accepted
    prompts = _repetitive_prompts() * 2  # the repeats hit the prefix cache
    tight = dict(num_blocks=24, block_size=8, max_num_batched_tokens=32)  # too small for all at once
    expected = _tokens(LLM(str(path), num_blocks=256, block_size=8), prompts)
    llm = LLM(str(path), speculative_config=spec, **tight)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in outs) > 0
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0
    _assert_pool_clean(llm)


def test_stop_token_and_max_tokens_inside_accepted_drafts(tiny_model) -> None:
    """A burst of accepted drafts still ends exactly at max_tokens or at a stop token."""
    path, _ = tiny_model("llama_gqa_tied")
    base = LLM(str(path), num_blocks=64, block_size=8)
    llm = LLM(str(path), num_blocks=64, block_size=8, speculative_config=_draft(path, k=4))
    prompt = _repetitive_prompts()[:1]
    full = _tokens(base, prompt)[0]
    stop_at = full[9]
    for params in (
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_at]),
    ):
        assert _tokens(llm, prompt, params) == _tokens(base, prompt, params)
    _assert_pool_clean(llm)


def test_speculation_switches_off_above_batch_size(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    spec = {**NGRAM, "disable_by_batch_size": 3}
    llm = LLM(str(path), num_blocks=128, block_size=8, speculative_config=spec)
    prompts = _repetitive_prompts()[:3]  # same length: the three run (and finish) together
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    _tokens(llm, [{"prompt_token_ids": p["prompt_token_ids"][:36]} for p in prompts], params)
    assert llm.engine.stats().spec_decode.num_drafts == 0
    _tokens(llm, prompts[:1], params)  # alone it speculates
    assert llm.engine.stats().spec_decode.num_drafts > 0


def test_per_request_num_speculative_tokens(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), num_blocks=128, block_size=8, speculative_config=_draft(path, k=4))
    prompt = _repetitive_prompts()[:1]
    off = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, num_speculative_tokens=0)
    _tokens(llm, prompt, off)
    assert llm.engine.stats().spec_decode.num_drafts == 0
    one = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, num_speculative_tokens=1)
    _tokens(llm, prompt, one)
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_draft_tokens == stats.num_drafts  # one draft per step
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SamplingParams(num_speculative_tokens=-1)


def test_seeded_sampling_same_alone_and_in_a_batch(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), num_blocks=128, block_size=8, speculative_config=_draft(path, k=3, draft_num_layers=1))
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True, seed=7)
    prompts = _repetitive_prompts()
    alone = _tokens(llm, prompts[:1], seeded)[0]
    others = SamplingParams(temperature=0.8, max_tokens=24, ignore_eos=True)
    batch = llm.generate(prompts, [seeded, others, others, others], use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone
    assert llm.engine.stats().spec_decode.num_drafts > 0


def test_bad_speculative_config_is_a_clear_error(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    for bad, message in [
        ({"method": "medusa"}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "draft_model"}, 'needs "model"'),
        ({"method": "ngram", "lookahead": 3}, "unknown speculative_config keys"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(str(path), num_blocks=16, speculative_config=bad)
    other, _ = tiny_model("qwen2_gqa_bias")  # same vocabulary size; different hidden size is fine
    LLM(str(path), num_blocks=16, speculative_config=_draft(other))


def test_smollm_greedy_identical_with_speculation(smollm, smollm_path: Path) -> None:
    """The real model on input-grounded chats (where n-gram drafts are accepted), one at a
    time and as one batch; the draft model is SmolLM2 cut to its first 4 layers."""
    from cadenza.benchmarks.spec import prompts

    chats = prompts()[::3]
    params = SamplingParams(temperature=0, max_tokens=48)
    inputs = [smollm.get_tokenizer().apply_chat_template(chat) for chat in chats]
    expected = _tokens(smollm, inputs, params)
    ngram = LLM(str(smollm_path), num_blocks=512, speculative_config=NGRAM)
    assert [_tokens(ngram, [p], params)[0] for p in inputs] == expected
    stats = ngram.engine.stats().spec_decode
    assert stats.num_accepted_tokens > stats.num_drafts  # more than one accepted draft per step on average
    draft = LLM(str(smollm_path), num_blocks=512, speculative_config=_draft(smollm_path, k=3, draft_num_layers=4))
    assert _tokens(draft, inputs[:2], params) == expected[:2]
    assert draft.engine.stats().spec_decode.num_drafts > 0
