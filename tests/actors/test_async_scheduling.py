"""Async scheduling (one step ahead): step N + 1 is planned before step N's tokens are back,
the runner appends its own samples, and the outputs are exactly those of stepping one at a
time: greedy and seeded sampling, penalties, chunked prefill, stops, preemption, aborts, a
step that raises (structured outputs: test_structured_outputs.py; the actor path's timeline:
test_timeline.py). Also the scheduler's placeholders on their own and the setting's rules."""

from __future__ import annotations

import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.actors import model_runner
from cadenza.actors.block_pool import BlockPool
from cadenza.actors.device_samples import DeviceSamples
from cadenza.actors.kv_cache_manager import KVCacheManager
from cadenza.actors.request import Request
from cadenza.actors.scheduler import Scheduler
from cadenza.config import EngineConfig
from cadenza.messages import EngineRequest, ModelRunnerOutput


def _prompts(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(0, 160, (5 + 7 * i,), generator=g).tolist()} for i in range(n)]


def _mixed_params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=12, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, top_k=20, max_tokens=9, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, logprobs=2, ignore_eos=True),
    ]


def _run(llm: LLM, prompts: list[dict], params: list[SamplingParams]) -> list[tuple]:
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (c.token_ids, c.finish_reason, c.stop_reason, [sorted(lp) for lp in (c.logprobs or [])])
        for o in outs
        for c in o.outputs
    ]


def _pair(path: str, **kwargs) -> tuple[LLM, LLM]:  # noqa: ANN003 - EngineConfig's arguments
    return LLM(path, async_scheduling=False, **kwargs), LLM(path, async_scheduling=True, **kwargs)


def _assert_drained(llm: LLM, num_blocks: int) -> None:
    llm.engine.scheduler.check_invariants()
    assert not llm.engine.has_unfinished()
    assert llm.stats().kv_cache.num_free_blocks == num_blocks


@pytest.mark.parametrize("budget", [2048, 32])  # 32: prompts chunked over several steps
def test_ahead_equals_one_at_a_time(tiny_model, budget: int) -> None:
    path, _ = tiny_model()
    sync, ahead = _pair(str(path), num_blocks=128, block_size=8, max_num_batched_tokens=budget)
    assert ahead.engine.scheduler.schedule_ahead and not sync.engine.scheduler.schedule_ahead
    prompts, params = _prompts(6), _mixed_params()
    assert _run(ahead, prompts, params) == _run(sync, prompts, params)
    _assert_drained(ahead, 128)
    # The engine is reused: a second batch after the first drained gives the same again.
    assert _run(ahead, prompts[:3], params[3:]) == _run(sync, prompts[:3], params[3:])


def test_stops_and_min_tokens_end_where_they_do_one_at_a_time(tiny_model) -> None:
    """A stop token the runner sees first: the step launched before that token reached the
    host computes the request once more (its token dropped), and then nothing."""
    path, _ = tiny_model()
    sync, ahead = _pair(str(path), num_blocks=128, block_size=8)
    prompts = _prompts(4, seed=1)
    free = sync.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    stops = [o.outputs[0].token_ids[3] for o in free]  # each stream's 4th token
    params = [
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stops[0]]),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stops[1]], min_tokens=6),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stops[2]], include_stop_str_in_output=True),
        SamplingParams(temperature=0, max_tokens=20),
    ]
    got = _run(ahead, prompts, params)
    assert got == _run(sync, prompts, params)
    assert got[0][1:3] == ("stop", stops[0])
    _assert_drained(ahead, 128)


def test_preemption_on_a_small_pool(tiny_model) -> None:
    path, _ = tiny_model()
    sync, ahead = _pair(str(path), num_blocks=20, block_size=8)
    prompts = _prompts(5, seed=2)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=30, ignore_eos=True) for i in range(5)]
    assert _run(ahead, prompts, params) == _run(sync, prompts, params)
    assert ahead.stats().num_preemptions > 0
    _assert_drained(ahead, 20)


def test_abort_mid_run_frees_everything(tiny_model) -> None:
    path, _ = tiny_model()
    llm = LLM(str(path), async_scheduling=True, num_blocks=64, block_size=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for i, p in enumerate(_prompts(3, seed=3)):
        llm.engine.add_request(EngineRequest(request_id=f"r{i}", sampling_params=params, **p))
    for _ in range(5):
        llm.engine.step()
    aborted = llm.engine.abort(["r1"])
    assert [o.finish_reason for o in aborted] == ["abort"]
    outputs = []
    while llm.engine.has_unfinished():
        outputs += llm.engine.step()
    ended = {o.request_id: o.finish_reason for o in outputs if o.finish_reason is not None}
    assert ended == {"r0": "length", "r2": "length"}
    llm.engine.step()  # the step still in flight lands on nothing and the runner drops r1
    assert "r1" not in llm.engine.runner.requests
    _assert_drained(llm, 64)


def test_a_step_that_raises_fails_only_its_requests(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """max_num_seqs=1 keeps the poisoned request's steps to itself: it fails, including the
    step planned behind the failing one, and the request queued after it runs as it would."""
    path, _ = tiny_model()
    sync, ahead = _pair(str(path), num_blocks=64, block_size=8, max_num_seqs=1)
    prompt, params = _prompts(1, seed=4), [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    expected = _run(sync, prompt, params)
    real_execute = ahead.engine.runner.execute
    calls = {"poison": 0}

    def execute(so, previous=None):  # noqa: ANN001, ANN202
        if "poison" in so.num_scheduled_tokens:
            calls["poison"] += 1
            if calls["poison"] == 3:  # a decode step, with the next one already planned
                raise IndexError("a shape this request triggers")
        return real_execute(so, previous)

    monkeypatch.setattr(ahead.engine.runner, "execute", execute)
    poison = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ahead.engine.add_request(EngineRequest(request_id="poison", prompt_token_ids=[1, 2, 3], sampling_params=poison))
    assert _run(ahead, prompt, params) == expected
    assert "poison" not in ahead.engine.scheduler.requests
    _assert_drained(ahead, 64)


def _config(**kwargs) -> EngineConfig:  # noqa: ANN003 - EngineConfig's arguments
    return EngineConfig(model="m", **kwargs)


def test_the_setting_resolves_by_device_and_refuses_what_it_cannot_do() -> None:
    assert not _config(device="cpu").schedules_ahead
    assert not _config().schedules_ahead  # "auto" before placement
    assert _config(device="cuda").schedules_ahead
    assert not _config(device="cuda", tensor_parallel_size=2).schedules_ahead
    assert _config(device="cpu", async_scheduling=True).schedules_ahead
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert not _config(device="cuda", speculative_config=spec).schedules_ahead
    for bad in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}, {"speculative_config": spec}):
        with pytest.raises(ValueError, match="async_scheduling needs"):
            _config(async_scheduling=True, **bad)


def _scheduler(max_model_len: int = 64) -> Scheduler:
    kv = KVCacheManager(BlockPool(32), 4, False)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=max_model_len, schedule_ahead=True)


def _add(s: Scheduler, rid: str, prompt_len: int, max_tokens: int) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(1, prompt_len + 1))
    req = Request(EngineRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params), (), 1)
    s.add_request(req)
    return req


def test_scheduler_plans_on_placeholders_and_waits_when_an_output_may_end_it() -> None:
    s = _scheduler()
    req = _add(s, "a", prompt_len=6, max_tokens=3)
    first = s.schedule()  # the prompt, which samples token 1
    assert first.num_scheduled_tokens == {"a": 6} and list(req.in_flight) == [(6, True)]
    second = s.schedule()  # token 1's position, planned before token 1 is known
    (delta,) = second.cached_requests
    assert second.num_scheduled_tokens == {"a": 1} and delta.num_computed_tokens == 6 and delta.new_token_ids == []
    assert req.num_planned_tokens == 7 and req.num_placeholders == 2
    third = s.schedule()  # token 2's position: its sample, token 3, is the last one allowed
    assert third.num_scheduled_tokens == {"a": 1} and req.num_placeholders == 3
    assert s.schedule().num_scheduled_tokens == {}  # three samples in flight reach max_tokens: wait
    s.update(first, ModelRunnerOutput(sampled={"a": [11]}))
    assert req.output_token_ids == [11] and req.num_computed_tokens == 6 and req.num_sent_tokens == 7
    s.update(second, ModelRunnerOutput(sampled={"a": [12]}))
    (out,) = s.update(third, ModelRunnerOutput(sampled={"a": [13]}))
    assert out.finish_reason == "length" and req.output_token_ids == [11, 12, 13]
    assert not req.in_flight


def test_scheduler_fails_a_request_whose_due_sample_never_came() -> None:
    s = _scheduler()
    _add(s, "a", prompt_len=4, max_tokens=5)
    so = s.schedule()
    (out,) = s.update(so, ModelRunnerOutput(sampled={}))
    assert out.finish_reason == "error" and "sampled no token" in out.error
    assert not s.has_unfinished()


def test_scheduling_ahead_cannot_speculate() -> None:
    from cadenza.config import SpeculativeConfig

    kv = KVCacheManager(BlockPool(8), 4, False)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    with pytest.raises(ValueError, match="cannot speculate"):
        Scheduler(kv, 4, 64, 64, spec, schedule_ahead=True)


def test_the_next_step_is_fed_its_token_on_the_device_before_the_host_reads_it(
    tiny_model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each decode step's input id is the previous sample, gathered where it was sampled (a
    placeholder on the host), and the runner reads that sample on the host only after the
    step using it has run its forward pass: on a GPU the host never waits for step N before
    launching step N + 1."""
    path, _ = tiny_model()
    llm = LLM(str(path), async_scheduling=True, num_blocks=64, block_size=8)
    runner = llm.engine.runner
    log: list[str] = []
    embedded: list[list[int]] = []
    real_fed, real_settle, real_embed = model_runner.fed_ids, runner._settle, runner.model.embed

    def fed(input_ids: torch.Tensor, rows: list[int], previous: DeviceSamples, req_ids: list[str]) -> None:
        assert input_ids[rows].tolist() == [model_runner.PLACEHOLDER_ID] * len(rows)
        log.append("fed")
        real_fed(input_ids, rows, previous, req_ids)

    def settle() -> None:
        log.append("settle" if runner._previous is not None else "-")
        real_settle()

    def embed(ids: torch.Tensor) -> torch.Tensor:
        log.append("forward")
        embedded.append(ids.tolist())
        return real_embed(ids)

    monkeypatch.setattr(model_runner, "fed_ids", fed)
    monkeypatch.setattr(runner, "_settle", settle)
    monkeypatch.setattr(runner.model, "embed", embed)
    prompt = [5, 9, 2, 7]
    (out,) = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    tokens = out.outputs[0].token_ids
    assert embedded == [prompt] + [[t] for t in tokens[:-1]]
    # "-": a settle with nothing pending (the prompt's step; steps that sample nothing).
    assert [e for e in log if e != "-"] == ["forward"] + ["fed", "forward", "settle"] * 5
