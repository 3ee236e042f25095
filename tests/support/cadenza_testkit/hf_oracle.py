"""Teacher-forced log-probs from transformers and from Cadenza, their worst difference, and
transformers' greedy choice at every position of a sequence."""

from __future__ import annotations

import torch

from cadenza import LLM, SamplingParams


def hf_logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def hf_greedy_choices(
    model: torch.nn.Module, prompt: list[int], tokens: list[int], banned: tuple[int, ...] = ()
) -> list[int]:
    """The token transformers' greedy decoding picks after prompt + tokens[:i], for every i,
    from one teacher-forced forward. `tokens` is HF's greedy continuation exactly when it equals
    this list (by induction over i), so a test asserts that equality rather than running
    `generate` step by step: one forward instead of len(tokens), the same check. `banned`
    (e.g. EOS under min_tokens) is never picked, as min_new_tokens does in generate."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    logits[:, list(banned)] = float("-inf")
    return logits.argmax(-1).tolist()


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
