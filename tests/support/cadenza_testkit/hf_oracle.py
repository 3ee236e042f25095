"""Teacher-forced log-probs from transformers and from Cadenza, and their worst difference."""

from __future__ import annotations

import torch

from cadenza import LLM, SamplingParams


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def worst_full_distribution_diff(ours: list[dict], ref: torch.Tensor, vocab: int) -> float:
    """The largest |log-prob difference| over every position's whole distribution (ours[pos]
    is the prediction ref[pos - 1] makes)."""
    worst = 0.0
    for pos in range(1, len(ours)):
        got = torch.full((vocab,), float("nan"))
        for token, lp in ours[pos].items():
            got[token] = lp.logprob
        worst = max(worst, float((got - ref[pos - 1]).abs().max()))
    return worst


def our_prompt_logprobs(llm: LLM, ids: list[int], k: int) -> list[dict]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
    return out[0].prompt_logprobs
