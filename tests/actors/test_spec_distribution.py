"""Speculative sampling is lossless: with drafts, tokens are distributed exactly as the target's
own distribution, at temperature 1.0 and with top-k / top-p filters, for good and
deliberately bad drafts. Checked by chi-square over 20,000 samples (p > 0.001) against the
exact distribution computed from the HF model, both for the rejection sampler alone and
end to end through the engine."""

from __future__ import annotations

import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.actors.rejection_sampler import SpecRow, verify
from cadenza.actors.sampler import SamplingRow, sampling_probs

pytestmark = pytest.mark.heavy  # not in make test-quick: sampled distributions: thousands of draws per case

SAMPLES = 20_000
CONTEXT = [(7 * i) % 150 + 3 for i in range(10)]
FILTERS = {
    "temperature_1": dict(temperature=1.0),
    "top_k_5": dict(temperature=1.0, top_k=5),
    "top_p_min_p": dict(temperature=0.8, top_p=0.9, min_p=0.02),
}


def chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's test; cells expecting fewer than 5 samples are pooled into one."""
    n = counts.sum()
    expected = expected_probs.double() * n
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].double().sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    assert observed[~keep].sum() == 0, "samples where the target has no mass"
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = torch.tensor(float(len(observed) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, statistic / 2))


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The exact distribution the engine samples from for these logits (rows)."""
    rows = [SamplingRow(params, CONTEXT, [], ()) for _ in range(logits.shape[0])]
    probs = sampling_probs(logits.float(), rows)
    return probs / probs.sum(dim=-1, keepdim=True)


@torch.no_grad()
def hf_logits(model: torch.nn.Module, contexts: list[list[int]]) -> torch.Tensor:
    """Last-position logits of each (equal-length) context."""
    return model(torch.tensor(contexts)).logits[:, -1].float()


@pytest.fixture(scope="module")
def target(tiny_model):  # noqa: ANN201 - (path, logits after CONTEXT, logits after CONTEXT + [t] for every t)
    path, hf = tiny_model("llama_gqa_tied")
    vocab = hf.config.vocab_size
    first = hf_logits(hf, [CONTEXT])[0]
    second = hf_logits(hf, [CONTEXT + [t] for t in range(vocab)])
    return path, first, second


@pytest.mark.parametrize("name", list(FILTERS))
@pytest.mark.parametrize("draft", ["good", "bad_model", "bad_deterministic"])
def test_rejection_sampler_first_token_is_the_targets(target, tiny_model, name: str, draft: str) -> None:
    """One draft per sample, d ~ q; the first emitted token must follow p exactly."""
    _, first, second = target
    params = SamplingParams(**FILTERS[name])
    p = target_probs(first[None], params)[0]
    torch.manual_seed(0)
    if draft == "good":
        q = p.clone()
    elif draft == "bad_model":  # another random model's distribution
        _, other = tiny_model("llama_mha")
        q = target_probs(hf_logits(other, [CONTEXT]), params)[0]
    else:  # an n-gram-like fixed guess the target finds unlikely
        q = None
    if q is None:
        drafts = torch.full((SAMPLES,), int(p.argmin()))
    else:
        drafts = torch.multinomial(q, SAMPLES, replacement=True)
    logits = torch.stack([first.expand(SAMPLES, -1), second[drafts]], dim=1).reshape(2 * SAMPLES, -1)
    base = SamplingRow(params, CONTEXT, [], ())
    rows = [SpecRow(base, [int(d)], None if q is None else q[None]) for d in drafts]
    tokens, _ = verify(logits, rows)
    firsts = torch.tensor([t[0] for t in tokens])
    counts = torch.bincount(firsts, minlength=p.shape[0])
    assert chi_square_p_value(counts, p) > 0.001
    accepted = sum(len(t) == 2 for t in tokens)
    if draft == "good":
        assert accepted > 0.9 * SAMPLES  # q == p: (almost) every draft is accepted
    if draft == "bad_deterministic":
        assert accepted < 0.05 * SAMPLES


@pytest.mark.parametrize(("name", "method"), [("temperature_1", "bad_draft_model"), ("top_k_5", "ngram")])
def test_engine_second_token_distribution_under_speculation(target, tiny_model, name: str, method: str) -> None:
    """End to end: the second token of each request comes out of a verification step (the
    first is the prefill's own sample). Its marginal must be sum_t p(t) p(. | t)."""
    path, first, second = target
    params = SamplingParams(max_tokens=3, ignore_eos=True, **FILTERS[name])  # room for a draft at step 2
    exact = target_probs(first[None], params)[0] @ target_probs(second, params)
    if method == "ngram":
        # Every token id appears once after the context, so any first token finds a match and
        # the proposal is whatever followed it: a deterministic, mostly wrong guess.
        prompt = CONTEXT + torch.randperm(first.shape[0], generator=torch.Generator().manual_seed(1)).tolist()
        exact = _exact_second(path, tiny_model, prompt, params)
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 1}
    else:
        prompt = CONTEXT
        other, _ = tiny_model("llama_mha")
        spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 3}
    llm = LLM(str(path), num_blocks=4096, block_size=16, max_num_seqs=1024, speculative_config=spec)
    outs = llm.generate([{"prompt_token_ids": prompt}] * SAMPLES, params, use_tqdm=False)
    seconds = torch.tensor([o.outputs[0].token_ids[1] for o in outs])
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts >= SAMPLES * 0.99  # (almost) every second token was verified
    assert chi_square_p_value(torch.bincount(seconds, minlength=exact.shape[0]), exact) > 0.001


def _exact_second(path, tiny_model, prompt: list[int], params: SamplingParams) -> torch.Tensor:  # noqa: ANN001
    _, hf = tiny_model("llama_gqa_tied")
    vocab = hf.config.vocab_size
    p1 = target_probs(hf_logits(hf, [prompt]), params)[0]
    p2 = target_probs(hf_logits(hf, [prompt + [t] for t in range(vocab)]), params)
    return p1 @ p2
