"""Session pins: a conversation's prefix survives a burst of other work between its turns,
within the pinned budget and its TTL; and priority orders admission."""

from __future__ import annotations

from cadenza import LLM, SamplingParams
from cadenza.actors.block_pool import BlockPool
from cadenza.actors.session_pins import SessionPins

GREEDY = SamplingParams(temperature=0, max_tokens=4)


def _burst(n: int, length: int, seed: int) -> list[dict]:
    return [{"prompt_token_ids": [(seed * 31 + i * 7 + j) % 150 + 5 for j in range(length)]} for i in range(n)]


def _second_turn_cached(llm: LLM, session: str | None) -> int:
    history = {"prompt_token_ids": list(range(10, 74))}  # 64 tokens: 4 full blocks
    first = llm.generate([history], GREEDY, use_tqdm=False, session_ids=[session])[0]
    llm.generate(_burst(12, 64, seed=1), GREEDY, use_tqdm=False)  # batch work fills and churns the pool
    turn = {"prompt_token_ids": first.prompt_token_ids + first.outputs[0].token_ids + [5, 6, 7]}
    return llm.generate([turn], GREEDY, use_tqdm=False, session_ids=[session])[0].num_cached_tokens


def test_pinned_session_keeps_its_prefix_through_a_burst(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    pinned = LLM(str(path), num_blocks=40, block_size=16, max_pinned_fraction=0.25)
    assert _second_turn_cached(pinned, "chat-1") == 64
    assert pinned.stats().num_pinned_blocks == 4  # the second turn's blocks replaced the first's
    unpinned = LLM(str(path), num_blocks=40, block_size=16, max_pinned_fraction=0.25)
    assert _second_turn_cached(unpinned, None) == 0  # without a session the burst evicted it


def test_pins_expire_and_stay_within_their_budget() -> None:
    now = [0.0]
    pool = BlockPool(10)
    pins = SessionPins(pool, max_blocks=4, ttl_s=5.0, clock=lambda: now[0])
    a, b = pool.allocate(3), pool.allocate(3)
    pins.pin("a", a)
    pins.pin("b", b)  # 6 > 4: the older session gives way
    pool.release(a)
    pool.release(b)
    assert pins.pinned("a") == [] and pins.pinned("b") == [blk.block_id for blk in b]
    assert pool.num_free_blocks == 7
    now[0] = 6.0
    pins.expire()
    assert pins.num_pinned_blocks == 0 and pool.num_free_blocks == 10
    pool.check_invariants()


def test_high_priority_request_is_admitted_before_queued_batch_work(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), num_blocks=256, max_num_seqs=2)
    batch = _burst(6, 32, seed=2)
    urgent = {"prompt_token_ids": [9, 8, 7, 6, 5]}
    for rid, prompt in enumerate([*batch, urgent]):
        llm.engine.add_request(_request(str(rid), prompt, priority=0 if prompt is urgent else 10))
    first_admitted = []
    while llm.engine.has_unfinished() and len(first_admitted) < 3:
        for out in llm.engine.step():
            if out.request_id not in first_admitted:
                first_admitted.append(out.request_id)
    assert "6" in first_admitted[:3]  # arrived last, ran among the first


def _request(rid: str, prompt: dict, priority: int):  # noqa: ANN202
    from cadenza.messages import EngineRequest

    return EngineRequest(
        request_id=rid, prompt_token_ids=prompt["prompt_token_ids"], sampling_params=GREEDY, priority=priority
    )


def test_a_tenant_never_replaces_another_tenants_pin() -> None:
    pool = BlockPool(10)
    pins = SessionPins(pool, max_blocks=8, ttl_s=5.0)
    a, b = pool.allocate(2), pool.allocate(2)
    pins.pin("chat", a, tenant="alice")
    pins.pin("chat", b, tenant="bob")  # the same prompt_cache_key, another tenant
    assert pins.pinned("chat", "alice") == [blk.block_id for blk in a]
    assert pins.pinned("chat", "bob") == [blk.block_id for blk in b]
    pins.unpin("chat", "bob")
    assert pins.pinned("chat", "alice") == [blk.block_id for blk in a]
    pins.check_invariants()


def test_pins_are_bounded_per_tenant_and_in_all_even_when_they_own_no_blocks() -> None:
    pool = BlockPool(10)
    pins = SessionPins(pool, max_blocks=8, ttl_s=5.0, max_sessions=5, max_sessions_per_tenant=3)
    prompt = pool.allocate(2)  # one system prompt every session shares: a pin adds no blocks of its own
    for i in range(10):
        pins.pin(f"s{i}", prompt, tenant="alice")
    assert pins.sessions_of("alice") == 3 and pins.pinned("s9", "alice") and not pins.pinned("s6", "alice")
    for i in range(2):
        pins.pin(f"s{i}", prompt, tenant="bob")
    assert pins.sessions_of("alice") == 3 and pins.sessions_of("bob") == 2  # bob took nothing of alice's
    pins.pin("s2", prompt, tenant="carol")  # past max_sessions: the least recently pinned gives way
    assert pins.num_sessions == 5 and pins.sessions_of("alice") == 2 and not pins.pinned("s7", "alice")
    pins.pin("empty", [], tenant="carol")  # holds nothing: not kept, so not counted
    assert pins.num_sessions == 5 and pins.sessions_of("carol") == 1
    pins.check_invariants()
    pins.clear()
    pool.release(prompt)
    assert pool.num_free_blocks == 10
    pool.check_invariants()


def test_a_drain_exports_every_pinned_block_once_newest_sessions_first() -> None:
    pool = BlockPool(10)
    pins = SessionPins(pool, max_blocks=8, ttl_s=5.0)
    shared, a, b = pool.allocate(1), pool.allocate(2), pool.allocate(1)
    pins.pin("a", shared + a)
    pins.pin("b", shared + b)  # one system-prompt block under both
    assert [x.block_id for x in pins.pinned_blocks()] == [0, 3, 1, 2]
