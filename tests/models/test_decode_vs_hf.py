"""One-token decode steps against HF transformers, for every tiny config.

A lone request decodes one token a step, which on the CPU runs all layers as one C call
(csrc/decode_layer.c); the `torch` backend runs the same steps op by op. Both must give HF's
greedy tokens and, at every generated position, HF's log-prob of the chosen token.
"""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.hf_oracle import hf_logprobs
from cadenza_testkit.tiny_models import TINY, TINY_CONFIGS

from cadenza import LLM, SamplingParams
from cadenza.kernels.cpu.decode_stack import decode_layers_available

# Triton's kernels run under its interpreter on the CPU, a few seconds a family: one family
# stays in make test-quick as the smoke case, the others are heavy (make test runs them all).
QUICK_TRITON = "llama_gqa_tied"
# Each interpreted decode step costs ~0.35 s: the Triton cases decode 12 tokens (21 -> 33, over
# two block boundaries and past every tiny sliding window), the others 30.
STEPS = {"cpu": 30, "torch": 30, "triton": 12}
DECODE_CASES = [
    pytest.param(kind, kernels, marks=[pytest.mark.heavy] if kernels == "triton" and kind != QUICK_TRITON else [])
    for kind in sorted(TINY_CONFIGS)
    for kernels in ("cpu", "torch", "triton")
]


@pytest.mark.parametrize(("kind", "kernels"), DECODE_CASES)
def test_greedy_decode_steps_match_hf(tiny_model, monkeypatch: pytest.MonkeyPatch, kind: str, kernels: str) -> None:
    if kernels == "cpu" and not decode_layers_available():
        pytest.skip("no C compiler: the CPU kernels cannot be built here")
    monkeypatch.setenv("CADENZA_KERNELS", kernels)
    path, hf = tiny_model(kind)
    llm = LLM(str(path), block_size=8, num_blocks=64)
    # Bound at load under the `cpu` backend only; the others run the same steps op by op, and
    # so do models whose layers the C stack does not compute (q/k norms, experts, Gemma's).
    model = llm.engine.runner.model
    assert (model.decode_stack is not None) == (kernels == "cpu" and model.cfg.plain_layers)
    prompt = torch.randint(0, TINY["vocab_size"], (21,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=STEPS[kernels], ignore_eos=True, logprobs=1)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    ref = hf_logprobs(hf, prompt + out.token_ids)
    worst = 0.0
    for i, (token, top) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        expected = ref[len(prompt) - 1 + i]
        assert token == int(expected.argmax()), f"greedy token {i} differs from HF's"
        worst = max(worst, abs(top[token].logprob - float(expected[token])))
    assert worst <= 1e-3, f"max |logprob diff| {worst}"


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_greedy_ids_match_hf_through_chunks_a_prefix_hit_and_preemption(tiny_model, kind: str) -> None:
    """Every family through the scheduler's hard paths: prompts prefilled in chunks of 8, a
    second wave that reuses the first prompt's cached blocks, and a pool too small for the
    wave, so requests are preempted and recomputed; greedy ids stay HF's."""
    path, hf = tiny_model(kind)
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(0, TINY["vocab_size"], (24,), generator=gen).tolist()
    prompts = [shared] + [shared + torch.randint(0, TINY["vocab_size"], (4,), generator=gen).tolist() for _ in range(3)]
    # A model whose every layer slides holds only its window's blocks: a smaller pool preempts it.
    num_blocks = 9 if kind == "mistral_sliding" else 14
    llm = LLM(str(path), block_size=4, num_blocks=num_blocks, max_num_batched_tokens=8, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    stats = llm.stats()
    assert stats.kv_cache.hits >= 20 and stats.num_preemptions > 0, stats  # a prefix hit, a preemption
    for prompt, out in zip(prompts, first + rest, strict=True):
        ids = out.outputs[0].token_ids
        ref = hf_logprobs(hf, prompt + ids)
        assert ids == ref[len(prompt) - 1 : -1].argmax(-1).tolist()
