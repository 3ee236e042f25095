"""Scheduler scenarios on a tiny model: budgets, chunking, priority, preemption, abort."""

from __future__ import annotations

import itertools

import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.actors.block_pool import BlockPool
from cadenza.actors.kv_cache_manager import KVCacheManager
from cadenza.actors.request import Request
from cadenza.actors.scheduler import Scheduler
from cadenza.messages import EngineRequest, ModelRunnerOutput

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


class SteppedClock:
    """The scheduler's clock for aging: the test moves it one second per step."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _bare_scheduler(aging_s: float, num_blocks: int = 64, max_num_seqs: int = 1) -> tuple[Scheduler, SteppedClock]:
    clock = SteppedClock()
    kv = KVCacheManager(BlockPool(num_blocks), 4, False)
    return Scheduler(kv, max_num_seqs, 64, 64, priority_aging_s=aging_s, clock=clock), clock


def _queue(s: Scheduler, rid: str, priority: int, prompt_len: int = 4, max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    req = EngineRequest(request_id=rid, prompt_token_ids=[1] * prompt_len, sampling_params=params, priority=priority)
    s.add_request(Request(req, (), next(_arrivals)))
    return s.requests[rid]


_arrivals = itertools.count(1)


def _step(s: Scheduler) -> list[str]:
    """One step, each scheduled request sampling token 5 once its prompt is in; returns the
    requests it admitted, in order."""
    so = s.schedule()
    done = {
        rid: [5]
        for rid, n in so.num_scheduled_tokens.items()
        if s.requests[rid].num_planned_tokens + n >= s.requests[rid].num_tokens
    }
    s.update(so, ModelRunnerOutput(sampled=done))
    return [r.req_id for r in so.new_requests]


@pytest.mark.parametrize("aging_s", [1.0, 0.0])
def test_low_priority_work_completes_under_a_steady_stream_of_urgent_work(aging_s: float) -> None:
    """One slot; an interactive request (0) arrives every step and takes two (prompt, then
    one decode), so urgent work alone would fill the queue forever. Batch work at 10, one
    level per second of waiting, goes right after the ten urgent requests that arrived in its
    first ten seconds, ahead of every later one; strict priority (aging off) starves it."""
    s, clock = _bare_scheduler(aging_s)
    _queue(s, "batch", priority=10)
    admitted: list[str] = []
    for step in range(60):
        clock.now = float(step)
        _queue(s, f"urgent-{step}", priority=0)
        admitted += _step(s)
    s.check_invariants()
    if aging_s:
        assert admitted.index("batch") == 10 and admitted[:10] == [f"urgent-{i}" for i in range(10)]
        assert "batch" not in s.requests  # finished
    else:
        assert "batch" not in admitted and len(s.waiting) > 25


@pytest.mark.parametrize(("aging_s", "victim", "survivor"), [(1.0, "urgent", "batch"), (0.0, "batch", "urgent")])
def test_preemption_spares_work_that_has_aged(aging_s: float, victim: str, survivor: str) -> None:
    """The victim is chosen by the same rank: batch work (10) admitted at 0 s has waited more
    than its ten levels when urgent work (0) arrives at 20 s, so when the pool runs dry the
    newcomer is preempted; under strict priority (aging off) the batch work is."""
    s, clock = _bare_scheduler(aging_s, num_blocks=4, max_num_seqs=2)
    _queue(s, "batch", priority=10, max_tokens=12)
    _step(s)
    clock.now = 20.0
    _queue(s, "urgent", priority=0, max_tokens=12)
    for _ in range(5):  # the fifth: batch's ninth token needs its third block, and all four are taken
        _step(s)
    assert (s.requests[victim].num_preemptions, s.requests[survivor].num_preemptions) == (1, 0)
    assert [r.request_id for r in s.running] == [survivor]
    s.check_invariants()
