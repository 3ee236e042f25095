"""Sliding windows for real: a Mistral whose window is shorter than the conversation runs
past it in a pool far smaller than its context, its blocks behind the window returned as it
goes, with transformers' greedy tokens; a Gemma (sliding and global layers) keeps them all."""

from __future__ import annotations

import torch
from cadenza_testkit.hf_oracle import hf_logprobs

from cadenza import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def test_a_window_shorter_than_the_context_holds_only_the_window(tiny_model) -> None:
    path, hf = tiny_model("mistral_sliding")  # window 16 on every layer
    prompt = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    # 100 tokens would need 25 blocks of 4; the window and a step of 8 need 7 at a time.
    llm = LLM(str(path), block_size=4, num_blocks=12, max_num_batched_tokens=8)
    assert llm.engine.kv.window == 16
    ids = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.scheduler.check_invariants()
    assert len(ids) == 60 and llm.engine.kv.blocks_needed(100) > 12  # more than the pool, all run
    assert ids == hf_logprobs(hf, prompt + ids)[len(prompt) - 1 : -1].argmax(-1).tolist()
    stats = llm.stats().kv_cache
    assert stats.num_free_blocks == 12 and stats.evictions > 0, stats  # blocks went back and were reused


def test_gemma_keeps_every_block_for_its_global_layers(tiny_model) -> None:
    path, _ = tiny_model("gemma2_sliding")
    llm = LLM(str(path), block_size=4, num_blocks=64)
    assert llm.engine.kv.window is None  # its global layers read the whole context
