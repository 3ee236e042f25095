"""One request's failure is that request's alone, in the engine core (in-process, tiny model):
a sampler that breaks on one request's settings, a step that raises, a request that can
never fit, a deadline. Also the scheduler fixes that keep requests from hanging or
repeating output: max_tokens=None on a small pool, prompt logprobs after a preemption,
the fcfs policy."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.actors import model_runner
from cadenza.actors.request import Request
from cadenza.messages import EngineRequest

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
POISON_SEED = 666


def _prompts(n: int, length: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 160, (length + i,), generator=g).tolist()} for i in range(n)]


def _tokens(outs) -> list[list[int]]:  # noqa: ANN001
    return [o.outputs[0].token_ids for o in outs]


def _in_thread(fn, timeout: float = 120.0):  # noqa: ANN001, ANN202 - a hang guard, not a speed check
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), "the engine hung"
    return result[0]


@pytest.fixture
def llm(tiny_model) -> LLM:
    path, _ = tiny_model()
    return LLM(str(path), num_blocks=64, block_size=8)


def test_a_request_whose_sampling_breaks_fails_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sampler raises whenever its batch holds the poisoned request: the batch is sampled
    again one request at a time and only the poisoned one fails; the forward pass is shared."""
    good = _prompts(3, 12)
    expected = _tokens(llm.generate(good, GREEDY, use_tqdm=False))
    real_sample = model_runner.sample

    def fragile(logits: torch.Tensor, rows: list) -> tuple:
        if any(r.params.seed == POISON_SEED for r in rows):
            raise RuntimeError("poisoned row")
        return real_sample(logits, rows)

    monkeypatch.setattr(model_runner, "sample", fragile)
    poison = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, seed=POISON_SEED)
    outs = llm.generate([good[0], good[1], {"prompt_token_ids": [3, 4, 5]}, good[2]], [GREEDY, GREEDY, poison, GREEDY])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "length", "error", "length"]
    assert _tokens(outs[:2]) + _tokens(outs[3:]) == expected
    llm.engine.scheduler.check_invariants()
    assert llm.stats().kv_cache.num_free_blocks == 64


def test_a_step_that_raises_fails_only_its_requests(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_num_seqs=1: the poisoned request's steps run alone; the runner raising there fails
    it, and the request queued behind it runs to its reference output."""
    small = LLM(llm.config.model, num_blocks=64, block_size=8, max_num_seqs=1)
    prompt = _prompts(1, 9, seed=2)[0]
    expected = _tokens(small.generate(prompt, GREEDY, use_tqdm=False))
    real_execute = small.engine.runner.execute

    def execute(so, previous=None):  # noqa: ANN001, ANN202
        if "poison" in so.num_scheduled_tokens:
            raise IndexError("a shape this request triggers")
        return real_execute(so, previous)

    monkeypatch.setattr(small.engine.runner, "execute", execute)
    small.engine.add_request(EngineRequest(request_id="poison", prompt_token_ids=[1, 2, 3], sampling_params=GREEDY))
    outs = small.generate(prompt, GREEDY, use_tqdm=False)
    assert _tokens(outs) == expected
    assert "poison" not in small.engine.scheduler.requests
    small.engine.scheduler.check_invariants()


def test_max_tokens_none_on_a_pool_smaller_than_the_context_finishes(tiny_model) -> None:
    path, _ = tiny_model()
    small = LLM(str(path), num_blocks=4, block_size=8, max_model_len=128)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    (out,) = _in_thread(lambda: small.generate({"prompt_token_ids": list(range(1, 11))}, params, use_tqdm=False))
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 4 * 8 - 10  # as many as the pool holds
    with pytest.raises(ValueError, match="no room"):
        small.generate({"prompt_token_ids": list(range(1, 33))}, params, use_tqdm=False)


def test_a_request_that_can_never_fit_fails_instead_of_waiting_forever(llm: LLM) -> None:
    """One that slipped past the checks (added to the scheduler directly) is failed once the
    pool is empty and it still cannot be admitted."""
    scheduler = llm.engine.scheduler
    req = EngineRequest(request_id="huge", prompt_token_ids=[1] * 600, sampling_params=GREEDY)
    scheduler.add_request(Request(req, (), 1))
    scheduler.schedule()
    (failed,) = scheduler.take_failed()
    assert failed.request_id == "huge" and failed.finish_reason == "error" and "KV blocks" in failed.error
    assert not scheduler.has_unfinished()


def test_prompt_logprobs_are_not_repeated_after_preemption(tiny_model) -> None:
    path, _ = tiny_model()
    ps = _prompts(4, 8, seed=5)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=2)
    roomy = LLM(str(path), num_blocks=256, block_size=8).generate(ps, params, use_tqdm=False)
    tight = LLM(str(path), num_blocks=12, block_size=8)
    outs = tight.generate(ps, params, use_tqdm=False)
    assert tight.stats().num_preemptions > 0
    for got, want in zip(outs, roomy, strict=True):
        assert len(got.prompt_logprobs) == len(got.prompt_token_ids)  # None, then one per later token
        assert [sorted(p) for p in got.prompt_logprobs[1:]] == [sorted(p) for p in want.prompt_logprobs[1:]]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids


@pytest.mark.parametrize(("policy", "first"), [("fcfs", "low"), ("priority", "high")])
def test_scheduling_policy_decides_whether_priority_counts(tiny_model, policy: str, first: str) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), num_blocks=64, max_num_seqs=1, scheduling_policy=policy)
    for rid, priority in (("low", 5), ("high", -5)):  # "low" arrives first, with the worse priority
        llm.engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=GREEDY, priority=priority)
        )
    so = llm.engine.scheduler.schedule()
    assert [r.req_id for r in so.new_requests] == [first]


def test_a_request_past_its_deadline_ends_with_an_error(tiny_model) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), num_blocks=64, request_timeout_s=30)
    old = EngineRequest(
        request_id="old", prompt_token_ids=[1, 2], sampling_params=GREEDY, arrival_time=time.time() - 60
    )
    llm.engine.add_request(old)
    llm.engine.add_request(EngineRequest(request_id="new", prompt_token_ids=[1, 2], sampling_params=GREEDY))
    outputs = llm.engine.step()
    failed = [o for o in outputs if o.finish_reason == "error"]
    assert [o.request_id for o in failed] == ["old"] and "request_timeout_s=30" in failed[0].error
    assert "new" in llm.engine.scheduler.requests


def test_after_worker_loss_waiting_requests_run_and_nothing_cached_survives(llm: LLM) -> None:
    prefix = list(range(1, 33))
    llm.generate({"prompt_token_ids": prefix + [40]}, GREEDY, use_tqdm=False)
    assert llm.engine.kv.pool.cached  # the prefix's blocks are findable
    core = llm.engine
    core.add_request(EngineRequest(request_id="running", prompt_token_ids=prefix + [41], sampling_params=GREEDY))
    core.step()
    core.add_request(EngineRequest(request_id="waiting", prompt_token_ids=prefix + [42], sampling_params=GREEDY))
    outputs = core.reset_after_worker_loss("a worker died")
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("running", "error")]
    assert not core.kv.pool.cached and all(b.block_hash is None for b in core.kv.pool.blocks)
    core.scheduler.check_invariants()
    assert "waiting" in core.scheduler.requests
    core.runner = type(core.runner)(core.runner.model, core.num_blocks, 8, core.eos_token_ids)  # new, empty KV
    done, tokens = {}, []
    while core.has_unfinished():
        for out in core.step():
            done[out.request_id] = out
            tokens += out.new_token_ids
    assert done["waiting"].finish_reason == "length" and done["waiting"].num_cached_tokens == 0
    fresh = LLM(llm.config.model, num_blocks=64, block_size=8, enable_prefix_caching=False)
    assert tokens == _tokens(fresh.generate({"prompt_token_ids": prefix + [42]}, GREEDY, use_tqdm=False))[0]


def test_a_request_that_outgrows_the_pool_alone_fails_instead_of_preempting_itself_forever() -> None:
    """Added to the scheduler directly (the engine's checks refuse it): prompt plus output need
    more blocks than the pool has, so running alone it would preempt itself and come back
    forever (found by the property tests)."""
    from cadenza.actors.block_pool import BlockPool
    from cadenza.actors.kv_cache_manager import KVCacheManager
    from cadenza.actors.scheduler import Scheduler
    from cadenza.messages import ModelRunnerOutput

    scheduler = Scheduler(KVCacheManager(BlockPool(2), 4, False), 4, 2, 64)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    scheduler.add_request(
        Request(EngineRequest(request_id="a", prompt_token_ids=[1] * 6, sampling_params=params), (0,), 1)
    )
    failed = []
    for _ in range(200):
        so = scheduler.schedule()
        failed += scheduler.take_failed()
        if not scheduler.has_unfinished():
            break
        req = scheduler.requests["a"]
        n = so.num_scheduled_tokens.get("a", 0)
        done = req.num_computed_tokens + n >= req.num_tokens
        scheduler.update(so, ModelRunnerOutput(sampled={"a": [5]} if n and done else {}))
    assert [f.request_id for f in failed] == ["a"] and "outgrew the KV pool" in failed[0].error
    scheduler.check_invariants()
