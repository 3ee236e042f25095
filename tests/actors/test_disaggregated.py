"""Prefill/decode disaggregation (1P1D): a request prefilled on one engine, its prompt's KV
handed to another through the KV connector, decoded there, gives the colocated engine's tokens
exactly: greedy (with n-gram speculation on the decode side), a prompt over one prefill chunk,
a seeded sampled request; a repeated prompt's blocks are skipped (the decode engine holds
them), a failed hand-over recomputes, and no engine leaks a block."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import msgspec
import pytest

from cadenza import AsyncLLM, DisaggregatedLLM, SamplingParams
from cadenza.actors.disaggregated import parse_disaggregation

NUM_BLOCKS = 128
# A 100-token prompt takes 3 chunks; every prompt goes to a prefill engine (except where a test says).
ENGINE = dict(num_blocks=NUM_BLOCKS, max_num_batched_tokens=48, max_local_prefill_tokens=0)
PROMPTS = [list(range(5, 45)), list(range(100, 200)), [7] * 12]  # 2.5 blocks, 6.25 blocks, < 1 block


async def _run(llm, prompt: list[int], params: SamplingParams, **kw: str) -> tuple[list[int], str, str | None]:  # noqa: ANN001
    ids, text, reason = [], "", None
    async for out in llm.generate({"prompt_token_ids": prompt}, params, **kw):
        ids += out.outputs[0].token_ids
        text += out.outputs[0].text
        reason = out.outputs[0].finish_reason or reason
    return ids, text, reason


@pytest.fixture(scope="module")
def engines(ray_cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AsyncLLM, DisaggregatedLLM]]:  # noqa: ANN001
    from cadenza_testkit.tiny_models import build_tiny_chat_model

    tiny_chat_path = build_tiny_chat_model(tmp_path_factory.mktemp("pd"))
    colocated = AsyncLLM(str(tiny_chat_path), **ENGINE)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    split = DisaggregatedLLM(str(tiny_chat_path), "1P2D", speculative_config=spec, max_engine_restarts=0, **ENGINE)
    yield colocated, split
    colocated.shutdown()
    split.shutdown()


@pytest.mark.slow
def test_1p2d_gives_the_colocated_tokens(engines) -> None:  # noqa: ANN001
    colocated, split = engines
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)

    async def run() -> None:
        for prompt in PROMPTS:
            for params in (greedy, seeded):  # one session: both on the decode engine that holds it
                got = await _run(split, prompt, params, session_id=str(prompt[0]))
                assert got == await _run(colocated, prompt, params), (prompt, params)

    asyncio.run(run())
    stats = asyncio.run(split.stats())
    moved = stats.kv_transfer
    assert moved.num_handoffs == 6 and moved.num_fallbacks == 0
    # The first greedy run of each prompt moves its full blocks (2 + 6); the seeded rerun finds them held.
    assert moved.num_blocks_imported == 8 and moved.num_blocks_skipped == 8 and moved.num_bytes > 0
    assert moved.num_blocks_pulled == 8  # one node: copied straight out of the prefill engine's cache (ipc)
    # The 3-chunk prompt's first chunk (3 blocks) moved while its other chunks were prefilled.
    assert moved.num_blocks_streamed == 3
    assert [role for role, _ in stats.roles] == ["prefill", "decode", "decode"]
    decode = [s.engine for role, s in stats.roles if role == "decode"]
    assert sum(d.kv_cache.hits for d in decode) >= 8 * 16  # the imported blocks served the decode-side prompts
    assert all(d.spec_decode is not None for d in decode)  # speculation there, not on the prefill engine
    assert sum(d.spec_decode.num_drafts for d in decode) > 0 and stats.roles[0][1].engine.spec_decode is None


@pytest.mark.slow
def test_prefix_affinity_sends_a_shared_prefix_where_it_is_cached(engines) -> None:  # noqa: ANN001
    """Three requests over one long prefix land where the first left it (their blocks skipped,
    not moved again); a request with another prefix goes to the other idle engine (in turn)."""
    _, split = engines
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    shared = list(range(1000, 1064))  # 4 full blocks

    def queries() -> list[int]:  # prompt tokens each decode engine has looked up so far
        return [d.engine.kv_cache.queries for role, d in asyncio.run(split.stats()).roles if role == "decode"]

    before, start = msgspec.structs.replace(split.transfer), queries()
    for tail in ([1, 2, 3], [4, 5], [6]):
        asyncio.run(_run(split, shared + tail, greedy))
    moved, middle = split.transfer, queries()
    assert moved.num_blocks_imported - before.num_blocks_imported == 4  # once, by the first request
    assert moved.num_blocks_skipped - before.num_blocks_skipped == 8  # the next two found them there
    asyncio.run(_run(split, list(range(2000, 2040)), greedy))
    end = queries()
    (shared_engine,) = [i for i in range(2) if middle[i] > start[i]]  # all three on one engine
    (other_engine,) = [i for i in range(2) if end[i] > middle[i]]
    assert shared_engine != other_engine  # both idle: the new prefix took the other in turn


@pytest.mark.slow
def test_a_short_prompt_is_prefilled_where_it_decodes(engines, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """max_local_prefill_tokens: a prompt that short runs whole on its decode engine (no
    hand-over, the prefill engine never sees it); a longer one still goes through a prefill
    engine. Both give the colocated tokens."""
    colocated, split = engines
    monkeypatch.setattr(split, "config", dataclasses.replace(split.config, max_local_prefill_tokens=64))
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def prefill_queries() -> int:
        return asyncio.run(split.stats()).roles[0][1].engine.kv_cache.queries

    before, handoffs = prefill_queries(), split.transfer.num_handoffs
    short = list(range(3000, 3040))  # 40 tokens (a range no other test here uses)
    assert asyncio.run(_run(split, short, greedy)) == asyncio.run(_run(colocated, short, greedy))
    assert prefill_queries() == before and split.transfer.num_handoffs == handoffs
    long = list(range(3100, 3180))  # 80 tokens
    assert asyncio.run(_run(split, long, greedy)) == asyncio.run(_run(colocated, long, greedy))
    assert prefill_queries() > before and split.transfer.num_handoffs == handoffs + 1


@pytest.mark.slow
def test_a_failed_hand_over_recomputes_and_no_block_leaks(engines, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    colocated, split = engines
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def broken(*_: object) -> None:
        raise ConnectionError("the object store lost it")

    for decode in split.decode:  # whichever the router picks (by load: timing decides)
        monkeypatch.setattr(decode, "import_kv", broken)
    before = asyncio.run(split.stats()).kv_transfer.num_fallbacks
    prompt = list(range(300, 340))
    assert asyncio.run(_run(split, prompt, greedy)) == asyncio.run(_run(colocated, prompt, greedy))
    stats = asyncio.run(split.stats())
    assert stats.kv_transfer.num_fallbacks == before + 1
    for _, engine in stats.roles:
        assert engine.engine.num_running == engine.engine.num_waiting == 0
        # Free, or held for the first test's sessions (pins): no request holds any.
        assert engine.engine.kv_cache.num_free_blocks + engine.engine.num_pinned_blocks == NUM_BLOCKS


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["ipc", "nixl", "object_store"])
def test_a_draft_models_kv_moves_with_the_blocks(
    ray_cluster,  # noqa: ANN001
    tmp_path_factory: pytest.TempPathFactory,
    transport: str,
) -> None:
    """A draft model's KV shares the model's blocks, so it moves with them: the decode
    engine's copy of a handed-over prompt holds the prefill engine's draft KV as well, through
    any transport. (Before, the draft read whatever those blocks held: with SmolLM2 drafting
    for itself, 15 of 118 drafts accepted after a hand-over against 37 of 37 colocated.) The
    prefill engine runs the draft over the prompt and never proposes."""
    import numpy as np
    import ray
    from cadenza_testkit.tiny_models import build_tiny_chat_model

    path = str(build_tiny_chat_model(tmp_path_factory.mktemp("pd_draft")))
    spec = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    colocated = AsyncLLM(path, speculative_config=spec, **ENGINE)
    split = DisaggregatedLLM(path, "1P1D", speculative_config=spec, kv_transport=transport, **ENGINE)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        prompt = PROMPTS[1]  # 6 full blocks over 3 prefill chunks
        assert asyncio.run(_run(split, prompt, greedy)) == asyncio.run(_run(colocated, prompt, greedy))
        moved = split.transfer
        assert moved.num_blocks_imported == 6 and moved.num_blocks_pulled == (0 if transport == "object_store" else 6)
        (sent, sent_refs), (held, held_refs) = (
            asyncio.run(e.export_kv(prompt)) for e in (*split.prefill, *split.decode)
        )
        assert sent.block_hashes == held.block_hashes and len(sent.block_hashes) == 6
        sent_arrays, held_arrays = ray.get(sent_refs[0]), ray.get(held_refs[0])
        assert len(sent_arrays) == len(held_arrays) == 2  # the model's KV and the draft's
        for a, b in zip(sent_arrays, held_arrays, strict=True):
            np.testing.assert_array_equal(a, b)
        roles = asyncio.run(split.stats()).roles
        prefill, decode = (stats.engine.spec_decode for _, stats in roles)
        assert prefill is None or prefill.num_drafts == 0
        assert decode.num_draft_tokens > 0 and decode.num_accepted_tokens == decode.num_draft_tokens  # itself, greedy
    finally:
        colocated.shutdown()
        split.shutdown()


@pytest.mark.slow
def test_an_export_waiting_for_blocks_that_never_come_ends_at_its_bound(engines) -> None:  # noqa: ANN001
    """The streamed hand-over's wait is bounded: a prompt nothing caches gives an empty part
    once wait_s has passed (and at once without it), not a hang."""
    _, split = engines
    never = list(range(9000, 9040))  # 2 full blocks no engine has seen
    handoff, refs = asyncio.run(split.prefill[0].export_kv(never, None, 0, 0.2))
    assert handoff.block_hashes == [] and refs == []
    handoff, _ = asyncio.run(split.prefill[0].export_kv(never, None, 2, 30.0))  # nothing left to wait for
    assert handoff.block_hashes == []


def test_the_role_counts_are_checked() -> None:
    assert parse_disaggregation("2p3d") == (2, 3)
    for bad in ("1P", "0P1D", "P1D", "1D1P"):
        with pytest.raises(ValueError, match="disaggregation must look like 1P1D"):
            parse_disaggregation(bad)


@pytest.mark.slow
def test_a_dead_decode_engine_hands_its_request_to_the_other(engines, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """Kills the request's decode engine after ten tokens: the request resumes on the other
    decode engine after them, and the stream equals the colocated one. (400 tokens: the kill
    must land before the engine ends the request, though a loaded host may deliver the first
    ten late.) The prompt is prefilled on its decode engine (max_local_prefill_tokens): a
    handed-over request decodes through the same resuming leg."""
    import ray

    colocated, split = engines
    monkeypatch.setattr(split, "config", dataclasses.replace(split.config, max_local_prefill_tokens=64))
    greedy = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    prompt = list(range(500, 540))

    async def run() -> tuple[list[int], str, str | None]:
        ids, text, reason = [], "", None
        async for out in split.generate({"prompt_token_ids": prompt}, greedy, request_id="victim"):
            ids += out.outputs[0].token_ids
            text += out.outputs[0].text
            reason = out.outputs[0].finish_reason or reason
            if len(ids) >= 10 and not killed:
                killed.append(split.engine_of("victim"))
                ray.kill(killed[0].engine)
        return ids, text, reason

    killed: list = []
    resumes = split.transfer.num_decode_resumes
    assert asyncio.run(run()) == asyncio.run(_run(colocated, prompt, greedy))
    assert killed[0] in split.decode and killed[0].dead and split.transfer.num_decode_resumes == resumes + 1
    roles = [role for role, _ in asyncio.run(split.stats()).roles]
    assert roles.count("decode") == 1  # /stats: the live engines only


@pytest.mark.slow
def test_a_dead_prefill_engine_moves_its_work_to_the_decode_engines(engines) -> None:  # noqa: ANN001
    """It kills the module's prefill engine. Requests then compute their prompt on a decode
    engine, tokens equal, none lost; health holds while a decode engine serves. (It holds
    whether or not the decode engine test ran first: it counts the live decode engines.)"""
    import ray

    colocated, split = engines
    ray.kill(split.prefill[0].engine)
    failures = split.transfer.num_prefill_failures
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = list(range(400, 450))
    assert asyncio.run(_run(split, prompt, greedy)) == asyncio.run(_run(colocated, prompt, greedy))
    assert asyncio.run(_run(split, prompt, greedy)) == asyncio.run(_run(colocated, prompt, greedy))
    stats = asyncio.run(split.stats())
    live_decode = sum(not d.dead for d in split.decode)
    assert live_decode >= 1 and split.prefill[0].dead
    assert [role for role, _ in stats.roles] == ["decode"] * live_decode  # /stats: the live engines
    assert stats.kv_transfer.num_prefill_failures == failures + 2 and stats.engine.num_running == 0
    asyncio.run(split.check_health())  # still serving: the decode engines compute prompts


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "transport"), [("tp2", "ipc"), ("tp2", "nixl"), ("pp2", "ipc")])
def test_1p1d_sharded_on_both_sides(
    ray_cluster,  # noqa: ANN001
    tmp_path_factory: pytest.TempPathFactory,
    layout: str,
    transport: str,
) -> None:
    """Each TP rank's shard of a block (or each PP stage's layers) goes to the same rank or
    stage on the other side (worker actors, each copying its shard straight out of the same
    worker's shared cache there, mapped or read through NIXL). With TP and ipc, a prefill
    worker killed: the request it was prefilling is computed on the decode engine, the prefill
    engine rebuilds its workers, and the next hand-over pulls from the new workers' caches
    (rebuilt workers are new actors, so under nixl new agents by new names: nothing to reset,
    and the rebuild is not run twice)."""
    import numpy as np
    import ray
    from cadenza_testkit.tiny_models import build_tiny_chat_model

    path = str(build_tiny_chat_model(tmp_path_factory.mktemp("pd_tp2")))
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [list(range(20, 90)), list(range(120, 170)), list(range(220, 270))]  # 4, 3 and 3 full blocks
    single = AsyncLLM(path, **ENGINE)
    try:
        expected = [asyncio.run(_run(single, prompt, greedy)) for prompt in prompts]
    finally:
        single.shutdown()
    sharding = {"tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}[layout]
    split = DisaggregatedLLM(path, "1P1D", kv_transport=transport, **sharding, **ENGINE)
    try:
        assert asyncio.run(_run(split, prompts[0], greedy)) == expected[0]
        moved = split.transfer
        assert moved.num_blocks_imported == 4 and moved.num_fallbacks == 0  # 70 tokens: 4 full blocks
        assert moved.num_blocks_pulled == 4
        last = prompts[0]
        if (layout, transport) == ("tp2", "ipc"):
            ray.kill(ray.get(split.prefill[0].engine.workers.remote())[1])
            assert asyncio.run(_run(split, prompts[1], greedy)) == expected[1]  # its prefill step finds the death
            pulled, fallbacks = moved.num_blocks_pulled, moved.num_fallbacks
            assert asyncio.run(_run(split, prompts[2], greedy)) == expected[2]
            assert moved.num_blocks_pulled == pulled + 3 and moved.num_fallbacks == fallbacks
            assert asyncio.run(split.stats()).roles[0][1].num_worker_restarts == 1
            last = prompts[2]
        # Greedy tokens of a tiny random model barely hang on the KV: compare the bytes.
        (sent, sent_refs), (held, held_refs) = (asyncio.run(e.export_kv(last)) for e in (*split.prefill, *split.decode))
        assert sent.block_hashes == held.block_hashes and len(sent.block_hashes) == len(last) // 16
        assert len(sent_refs) == len(held_refs) == 2  # a worker each: two TP ranks or two PP stages
        for a, b in zip(ray.get(sent_refs), ray.get(held_refs), strict=True):  # per worker: [model's KV]
            np.testing.assert_array_equal(a[0], b[0])
    finally:
        split.shutdown()
