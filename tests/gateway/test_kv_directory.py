"""The KV directory (which replica caches which blocks, and whom a prompt should pull from) and
a replica's engine pulling a prefix from a peer's (gateway/peer_kv.py)."""

from __future__ import annotations

import asyncio

import pytest
import ray

from cadenza import AsyncLLM, SamplingParams, TokensPrompt
from cadenza.actors.kv_connector.engine_port import prefix_hashes
from cadenza.gateway.kv_directory import KVDirectory
from cadenza.gateway.peer_kv import PeerKVEngine


@ray.remote(num_cpus=0)
class _Engine:  # stands in for a replica's engine actor: the directory only holds its handle
    def name(self) -> str:
        return "engine"


def test_a_prompt_is_sent_to_the_replica_with_the_longest_run_beyond_its_own(ray_cluster: None) -> None:
    async def run() -> None:
        directory = KVDirectory("cadenza-kv-directory:test:locate")
        a, b = _Engine.remote(), _Engine.remote()
        chain = [bytes([i]) * 4 for i in range(6)]
        await directory.publish("a", 0, a, chain[:2])
        await directory.publish("b", 0, b, chain[:5])
        assert await directory.locate("c", chain) == ("b", b, 5)  # c holds nothing: the longest run
        assert await directory.locate("b", chain) is None  # b holds the most itself
        assert await directory.locate("a", chain, min_gain=4) is None  # b's run is 3 blocks longer than a's
        await directory.publish("a", 0, a, chain)
        assert (await directory.locate("b", chain))[::2] == ("a", 6)
        assert await directory.locate("a", [b"x" * 4, *chain]) is None  # a run starts at the first block
        await directory.publish("a", 1, a, chain[:1])  # a's engine was replaced: its cache is empty
        assert (await directory.locate("c", chain))[::2] == ("b", 5)
        await directory.forget("b")
        assert (await directory.locate("c", chain))[::2] == ("a", 1)
        assert await directory.replicas_known() == ["a"]
        # A drain: "a" hands blocks to "c", which passes them on when it drains in turn.
        await directory.publish("c", 0, b, [])
        await directory._call("hand_over", "a", "c", chain[3:])
        assert (await directory.locate("d", chain[3:]))[::2] == ("c", 3)
        assert await directory.forget("c") == chain[3:]
        assert await directory.recent_hand_overs() == [("a", "c", 3)]
        ray.kill(directory.actor)  # detached: it would outlive the test

    asyncio.run(run())


@pytest.mark.slow
def test_a_replica_pulls_a_cached_prefix_and_a_dead_peer_is_a_recompute(
    ray_cluster: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Two engines as two replicas: the second starts a prompt from the first's KV (copied
    straight out of its shared cache, as Serve replicas on one node do) and answers its greedy
    tokens; a peer whose engine is dead costs a recompute, never the request."""
    from cadenza_testkit.tiny_models import build_tiny_chat_model

    path = str(build_tiny_chat_model(tmp_path_factory.mktemp("peer_kv")))
    directory = KVDirectory("cadenza-kv-directory:test:pull")
    first, second = (
        PeerKVEngine(AsyncLLM(path, num_blocks=64, kv_transport="ipc"), directory, name, min_tokens=32, timeout_s=30)
        for name in "ab"
    )
    prompt, greedy = TokensPrompt(list(range(5, 90))), SamplingParams(temperature=0, max_tokens=6)

    async def run(engine: PeerKVEngine, ids: list[int] = prompt.token_ids) -> tuple[list[int], int]:
        out_ids, cached = [], 0
        async for out in engine.generate(TokensPrompt(ids), greedy):
            out_ids += out.outputs[0].token_ids
            cached = out.num_cached_tokens
        return out_ids, cached

    async def scenario() -> None:
        at_home, cached = await run(first)
        assert cached == 0
        moved, cached = await run(second)
        assert moved == at_home and cached == 80  # 5 full blocks of 85 tokens came across
        assert second.transfer.num_handoffs == 1 and second.transfer.num_blocks_imported == 5
        assert second.transfer.num_blocks_pulled == 5
        # A replica whose engine died, said to hold a longer run: the pull fails, the request does not.
        dead = AsyncLLM(path, num_blocks=16)
        longer = [*prompt.token_ids, *at_home, *range(300, 340)]
        await directory.publish("gone", 0, dead.engine, prefix_hashes(longer, 16, None))
        dead.shutdown()
        again, _ = await run(second, longer)
        assert len(again) == 6 and second.transfer.num_fallbacks == 1
        assert "gone" not in await directory.replicas_known()

    try:
        asyncio.run(scenario())
    finally:
        first.engine.shutdown()
        second.engine.shutdown()
        ray.kill(directory.actor)
