"""Teacher-forced log-probs against HF transformers, position by position."""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.hf_oracle import hf_logprobs, our_prompt_logprobs, worst_full_distribution_diff
from cadenza_testkit.tiny_models import TINY, TINY_CONFIGS

from cadenza import LLM


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("block_size,budget", [(16, 2048), (8, 7)])
def test_tiny_teacher_forced_logprobs(tiny_model, kind: str, block_size: int, budget: int) -> None:
    """Every position's full distribution; budget 7 forces chunked prefill over the paged cache."""
    path, hf = tiny_model(kind)
    vocab = TINY["vocab_size"]
    ids = torch.randint(0, vocab, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    # max_logprobs=-1: no cap, as in vLLM; the whole distribution is compared.
    llm = LLM(str(path), block_size=block_size, max_num_batched_tokens=budget, num_blocks=64, max_logprobs=-1)
    ours = our_prompt_logprobs(llm, ids, k=vocab)
    ref = hf_logprobs(hf, ids)
    assert ours[0] is None and len(ours) == len(ids)
    worst = worst_full_distribution_diff(ours, ref, vocab)
    assert worst <= 1e-3, f"max |logprob diff| {worst}"


def test_smollm_teacher_forced_logprobs(smollm, hf_smollm) -> None:
    tok = smollm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about paged attention and caches."}])
    ids = tok.encode(text, add_special_tokens=False) + tok.encode(" Blocks of memory, shared by many")
    ours = our_prompt_logprobs(smollm, ids, k=20)
    ref = hf_logprobs(hf_smollm, ids)
    worst = 0.0
    for pos in range(1, len(ids)):
        for token, lp in ours[pos].items():
            worst = max(worst, abs(lp.logprob - float(ref[pos - 1, token])))
        top = set(torch.topk(ref[pos - 1], 5).indices.tolist())
        assert top <= set(ours[pos]), f"top-5 differs at position {pos}"
    assert worst <= 1e-3, f"max |logprob diff| {worst}"
