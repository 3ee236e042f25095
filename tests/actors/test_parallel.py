"""Tensor and pipeline parallelism across worker actors: the same greedy tokens as one worker."""

from __future__ import annotations

import asyncio

import pytest

from cadenza import LLM, AsyncLLM, SamplingParams
from cadenza.models.config import ModelConfig
from cadenza.models.loader import DEFAULT_MODEL, read_model
from cadenza.models.tp import check_tp, head_slice

LAYOUTS = [(2, 1), (1, 2), (2, 2)]  # (tensor_parallel_size, pipeline_parallel_size)


def _cfg(heads: int, kv: int) -> ModelConfig:
    return ModelConfig("LlamaForCausalLM", 100, 64, 96, 2, heads, kv, 16, 1e-5, 1e4, 512, False)


def test_head_slices_follow_kv_groups() -> None:
    # SmolLM2's 9 query / 3 KV heads over 2 ranks: uneven, at group boundaries.
    first, second = head_slice(_cfg(9, 3), 2, 0), head_slice(_cfg(9, 3), 2, 1)
    assert (first.q_start, first.q_end, first.kv_start, first.kv_end) == (0, 6, 0, 2)
    assert (second.q_start, second.q_end, second.kv_start, second.kv_end) == (6, 9, 2, 3)
    # One KV head over 2 ranks: replicated, query heads split.
    mqa = [head_slice(_cfg(4, 1), 2, r) for r in (0, 1)]
    assert [(s.q_start, s.q_end, s.kv_start, s.kv_end) for s in mqa] == [(0, 2, 0, 1), (2, 4, 0, 1)]
    with pytest.raises(ValueError, match="query group"):
        check_tp(_cfg(6, 2), 4)


def _greedy_tokens(llm: AsyncLLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    async def one(ids: list[int]) -> list[int]:
        tokens: list[int] = []
        async for delta in llm.generate({"prompt_token_ids": ids}, params):
            tokens += delta.outputs[0].token_ids
        return tokens

    async def run() -> list[list[int]]:
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(run())


def _reference(model: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    llm = LLM(model, num_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# Every layout on the tied GQA model, then the last again through a Ray Compiled Graph; MQA's
# own case (its one KV head replicated over the TP ranks) needs only the TP layouts.
ALL_LAYOUTS = [(1, 1, False), *((t, p, False) for t, p in LAYOUTS), (2, 2, True)]


@pytest.mark.parametrize(
    ("kind", "layouts"), [("llama_gqa_tied", ALL_LAYOUTS), ("llama_mqa", [(2, 1, False), (2, 2, False)])]
)
def test_tiny_parallel_layouts_match_one_worker(
    ray_cluster, tiny_model, kind: str, layouts: list[tuple[int, int, bool]]
) -> None:
    path, _ = tiny_model(kind)
    prompts = [[(7 * i + j) % 150 + 3 for j in range(5 + 9 * i)] for i in range(4)]
    expected = _reference(str(path), prompts, 24)
    for tp, pp, compiled in layouts:
        llm = AsyncLLM(
            str(path), num_blocks=256, tensor_parallel_size=tp, pipeline_parallel_size=pp, use_compiled_graph=compiled
        )
        try:
            assert _greedy_tokens(llm, prompts, 24) == expected, f"tp={tp} pp={pp} compiled={compiled}"
            assert asyncio.run(llm.stats()).compiled_graph == compiled
        finally:
            llm.shutdown()


@pytest.mark.parametrize("kind", ["mixtral_moe", "qwen3_moe"])
def test_moe_tensor_and_expert_parallel_match_one_worker(ray_cluster, tiny_model, kind: str) -> None:
    """4 experts split by I over 2 TP ranks, then shared out whole (expert parallelism of 2,
    each rank computing its experts' part, summed over gloo): the same greedy tokens as one
    worker."""
    path, _ = tiny_model(kind)
    prompts = [[(11 * i + j) % 150 + 3 for j in range(4 + 7 * i)] for i in range(3)]
    expected = _reference(str(path), prompts, 16)
    for expert_parallel in (False, True):
        llm = AsyncLLM(str(path), num_blocks=128, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
        try:
            assert _greedy_tokens(llm, prompts, 16) == expected, f"expert_parallel={expert_parallel}"
        finally:
            llm.shutdown()


@pytest.mark.slow
def test_smollm_tensor_parallel_matches_one_worker(ray_cluster) -> None:
    """The real model where it is the point: TP=2 splits its 9 query / 3 KV heads unevenly. Its
    pipeline layouts split 30 layers evenly, which the tiny models' layouts above cover (each
    real-model layout costs ~13 s of the suite)."""
    path, cfg = read_model(DEFAULT_MODEL)
    assert (cfg.num_heads, cfg.num_kv_heads) == (9, 3)  # TP=2 splits its heads unevenly
    prompts = [[(31 * i + 17 * j) % 40000 + 200 for j in range(12 + 20 * i)] for i in range(3)]
    expected = _reference(DEFAULT_MODEL, prompts, 16)
    for tp, pp in [(2, 1)]:
        llm = AsyncLLM(DEFAULT_MODEL, num_blocks=128, tensor_parallel_size=tp, pipeline_parallel_size=pp)
        try:
            assert _greedy_tokens(llm, prompts, 16) == expected, f"tp={tp} pp={pp}"
        finally:
            llm.shutdown()
