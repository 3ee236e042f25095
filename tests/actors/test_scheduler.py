"""Scheduler scenarios on a tiny model: budgets, chunking, priority, preemption, abort."""

from __future__ import annotations

import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.messages import EngineRequest

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(n: int, length: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 160, (length + 3 * i,), generator=g).tolist()} for i in range(n)]


def texts(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


def test_chunked_prefill_respects_budget(tiny_model) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), max_num_batched_tokens=10, num_blocks=64, block_size=8)
    llm.engine.add_request(EngineRequest(request_id="r", prompt_token_ids=list(range(25)), sampling_params=GREEDY))
    so = llm.engine.scheduler.schedule()
    assert so.num_scheduled_tokens == {"r": 10}
    assert so.new_requests[0].block_ids == [0, 1]  # only what the chunk needs


def test_batch_equals_one_at_a_time(tiny_model) -> None:
    path, _ = tiny_model("llama_mha")
    ps = prompts(6, 20)
    alone = LLM(str(path), num_blocks=64)
    expected = [texts(alone.generate(p, GREEDY, use_tqdm=False))[0] for p in ps]
    batched = LLM(str(path), num_blocks=64, max_num_batched_tokens=16, block_size=8)
    assert texts(batched.generate(ps, GREEDY, use_tqdm=False)) == expected


def test_preemption_keeps_outputs(tiny_model) -> None:
    path, _ = tiny_model()
    ps = prompts(6, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = texts(LLM(str(path), num_blocks=256).generate(ps, params, use_tqdm=False))
    small = LLM(str(path), num_blocks=24, block_size=8)
    assert texts(small.generate(ps, params, use_tqdm=False)) == expected
    assert small.stats().num_preemptions > 0
    small.engine.scheduler.check_invariants()
    assert small.stats().kv_cache.num_free_blocks == 24


def test_priority_policy_admits_urgent_first(tiny_model) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), num_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    for rid, priority in (("low", 5), ("high", -1), ("mid", 0)):
        llm.engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=GREEDY, priority=priority)
        )
    order = []
    while llm.engine.has_unfinished():
        so = llm.engine.scheduler.schedule()
        order += [n.req_id for n in so.new_requests]
        llm.engine.scheduler.update(so, llm.engine.runner.execute(so))
    assert order == ["high", "mid", "low"]


def test_abort_frees_blocks(tiny_model) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), num_blocks=32)
    llm.engine.add_request(EngineRequest(request_id="a", prompt_token_ids=list(range(30)), sampling_params=GREEDY))
    llm.engine.step()
    assert llm.stats().kv_cache.num_free_blocks < 32
    (out,) = llm.engine.abort(["a"])
    assert out.finish_reason == "abort" and not llm.engine.has_unfinished()
    assert llm.stats().kv_cache.num_free_blocks == 32
    llm.engine.step()  # the runner drops its copy
    assert not llm.engine.runner.requests


def test_max_num_seqs_caps_running(tiny_model) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), num_blocks=64, max_num_seqs=2)
    for i in range(4):
        llm.engine.add_request(EngineRequest(request_id=str(i), prompt_token_ids=[1, 2], sampling_params=GREEDY))
    so = llm.engine.scheduler.schedule()
    assert sorted(so.num_scheduled_tokens) == ["0", "1"]


def test_prefix_cache_hit_gives_same_output(tiny_model) -> None:
    path, _ = tiny_model()
    prefix = prompts(1, 64, seed=9)[0]["prompt_token_ids"]
    second = {"prompt_token_ids": prefix + [5, 6, 7]}
    cold = LLM(str(path), num_blocks=64, enable_prefix_caching=False)
    expected = texts(cold.generate(second, GREEDY, use_tqdm=False))
    warm = LLM(str(path), num_blocks=64)
    warm.generate({"prompt_token_ids": prefix + [9]}, GREEDY, use_tqdm=False)
    out = warm.generate(second, GREEDY, use_tqdm=False)
    assert texts(out) == expected
    assert out[0].num_cached_tokens == 64
    assert warm.stats().kv_cache.hits == 64


@pytest.mark.parametrize("n", [2, 3])
def test_n_sequences_share_prompt_blocks(tiny_model, n: int) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), num_blocks=64, enable_prefix_caching=False)
    ids = list(range(1, 41))  # 2 full blocks of 16 + 8 tokens
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(n=n, seed=7, max_tokens=8), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == list(range(n))
    assert len({tuple(c.token_ids) for c in out.outputs}) == n  # distinct samples
    assert llm.stats().kv_cache.hits == 32 * (n - 1)  # followers reuse the leader's full blocks
