"""kv_cache_dtype="float16": K and V rounded to fp16 in the cache, everything else as before.

Against HF transformers in fp32: fp16 rounding of K and V moves log-probs by up to about 1e-2
on the tiny random models (their weights are scaled up, so activations are large) and much
less on SmolLM2; greedy tokens stay HF's. Covered on the C kernels (the single-token decode
stack, decode rows and tiled prefill, which read fp16 caches) and on the torch reference.
"""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.hf_oracle import hf_greedy_choices, hf_logprobs, our_prompt_logprobs, worst_full_distribution_diff
from cadenza_testkit.tiny_models import POOL_MODEL, TINY

from cadenza import LLM, SamplingParams
from cadenza.actors.engine_core import num_kv_blocks
from cadenza.config import EngineConfig
from cadenza.weight_format import WeightFormat

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def _cache_dtypes(llm: LLM) -> set[torch.dtype]:
    return {t.dtype for pair in llm.engine.runner.kv_caches for t in pair}


def _worst_prompt_logprob_diff(llm: LLM, hf: torch.nn.Module, ids: list[int]) -> float:
    vocab = TINY["vocab_size"]
    return worst_full_distribution_diff(our_prompt_logprobs(llm, ids, k=vocab), hf_logprobs(hf, ids), vocab)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kind", ["llama_gqa_tied", "qwen2_gqa_bias"])
def test_fp16_kv_tracks_transformers(tiny_model, monkeypatch: pytest.MonkeyPatch, kind: str, backend: str) -> None:
    """A 90-token prompt in chunks of 32 (prefill and extends over the fp16 cache), then 40
    greedy tokens (single-token decode steps)."""
    monkeypatch.setenv("CADENZA_KERNELS", backend)
    path, hf = tiny_model(kind)
    ids = torch.randint(0, TINY["vocab_size"], (90,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(str(path), kv_cache_dtype="float16", num_blocks=64, max_logprobs=-1, max_num_batched_tokens=32)
    assert _cache_dtypes(llm) == {torch.float16}
    assert _worst_prompt_logprob_diff(llm, hf, ids) <= 3e-2
    got = llm.generate({"prompt_token_ids": ids[:20]}, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == 40 and list(got) == hf_greedy_choices(hf, ids[:20], list(got))


def test_fp16_kv_on_smollm(smollm_path, hf_smollm) -> None:
    """SmolLM2 (its GGUF's types, fp32 activations): a chat prompt's log-probs and 48 greedy
    tokens against transformers."""
    llm = LLM(str(smollm_path), kv_cache_dtype="float16", num_blocks=256)
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "Explain what a KV cache stores, briefly."}])
    ids = tok.encode(text, add_special_tokens=False)
    ours, ref = our_prompt_logprobs(llm, ids, k=5), hf_logprobs(hf_smollm, ids)
    worst = max(abs(lp.logprob - float(ref[pos - 1, t])) for pos in range(1, len(ids)) for t, lp in ours[pos].items())
    assert worst <= 2e-2, f"max |logprob diff| {worst}"
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(got) == 48 and list(got) == hf_greedy_choices(hf_smollm, ids, list(got))


def test_an_fp16_pool_holds_twice_the_blocks_in_the_same_memory() -> None:
    block_bytes = 8192  # the fp32 block of test_block_pool's model
    for kv, blocks in (("auto", 10), ("float32", 10), ("float16", 20)):
        config = EngineConfig(model="m", dtype="float32", kv_cache_dtype=kv, kv_cache_memory=10 * block_bytes)
        assert num_kv_blocks(config, POOL_MODEL, 4096) == blocks, kv


def test_the_kv_cache_dtype_is_checked() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="on CUDA the KV cache is in the activations' dtype"):
        WeightFormat.resolve("auto", None, 32, "cuda", False, "float16")
    assert WeightFormat.resolve("float32", None, 32, "cpu", False, "float16").kv_dtype == torch.float16
    assert WeightFormat.resolve("float32", None, 32, "cpu").kv_dtype == torch.float32


def test_auto_is_fp16_on_a_cpu_only_where_activations_are_rounded_already() -> None:
    """Exact fp32 math keeps an fp32 cache; int8 activations or bf16 GEMMs already round more
    than fp16 K/V would, so the pool halves there."""
    assert WeightFormat.resolve("auto", "gguf", 32, "cpu", False, cpu_gemm_dtype="float32").kv_dtype == torch.float32
    assert WeightFormat.resolve("auto", "gguf", 32, "cpu", True, cpu_gemm_dtype="float32").kv_dtype == torch.float16
    assert WeightFormat.resolve("auto", "gguf", 32, "cpu", False, cpu_gemm_dtype="bfloat16").kv_dtype == torch.float16
    explicit = WeightFormat.resolve("auto", "gguf", 32, "cpu", True, "float32", cpu_gemm_dtype="float32")
    assert explicit.kv_dtype == torch.float32
