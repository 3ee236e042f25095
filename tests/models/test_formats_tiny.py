"""Every weight format on tiny random models: loads, chooses the packed kernels, runs the C
decode stack for one-token steps exactly as the op-by-op layers do, and stays close to fp32."""

from __future__ import annotations

import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.kernels.cpu.packed import packed_available
from cadenza.kernels.linear.packed import PackedLinear
from cadenza.models.embedding import PackedEmbedding

FORMATS = [
    dict(dtype="bfloat16", quantization="none"),
    dict(dtype="float16", quantization="none"),
    dict(quantization="int8"),
    dict(quantization="int4", quantization_group_size=32),
]


def _logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=160), use_tqdm=False)
    rows = out[0].prompt_logprobs[1:]
    return torch.tensor([[position[t].logprob for t in sorted(position)] for position in rows])


@pytest.mark.parametrize("kind", ["llama_gqa_tied", "qwen3_qk_norm", "mixtral_moe"])
@pytest.mark.parametrize("fmt", FORMATS, ids=["bf16", "f16", "int8", "int4"])
def test_each_format_packs_every_weight_and_tracks_fp32(tiny_model, fmt: dict, kind: str) -> None:
    path, _ = tiny_model(kind)
    ids = torch.randint(3, 160, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    base = LLM(str(path), num_blocks=32, dtype="float32", quantization="none", max_logprobs=-1)
    llm = LLM(str(path), num_blocks=32, max_logprobs=-1, **fmt)
    model = llm.engine.runner.model
    assert all(isinstance(layer.mlp.down_proj.method, PackedLinear) for layer in model.layers)
    assert isinstance(model.embed_tokens, PackedEmbedding)
    if model.cfg.tie_word_embeddings:  # it reads the LM head's storage
        assert model.embed_tokens.packed is model.lm_head.method.packed()
    ours, ref = _logprobs(llm, ids), _logprobs(base, ids)
    kl = (ref.exp() * (ref - ours)).sum(-1).mean().item()  # KL(fp32 || format), nats per position
    assert kl < {"bf16": 1e-3, "f16": 1e-5, "int8": 1e-2, "int4": 0.1}[model.weights_label.split("-")[0]]


def test_bf16_gemms_take_prefill_attention_along_and_track_fp32(tiny_model) -> None:
    """cpu_gemm_dtype bfloat16 also makes prefill attention's products bf16 (where the C
    kernel can: csrc/prefill_bf16.h); float32 keeps both fp32. A 48-token prompt is one long
    prefill: its logprobs stay within bf16's distance of fp32's."""
    path, _ = tiny_model("llama_gqa_tied")
    ids = torch.randint(3, 160, (48,), generator=torch.Generator().manual_seed(1)).tolist()
    llm = LLM(str(path), num_blocks=32, max_logprobs=-1, quantization="int4", cpu_gemm_dtype="bfloat16")
    exact = LLM(str(path), num_blocks=32, max_logprobs=-1, quantization="int4", cpu_gemm_dtype="float32")
    assert all(layer.self_attn.bf16_products for layer in llm.engine.runner.model.layers)
    assert not any(layer.self_attn.bf16_products for layer in exact.engine.runner.model.layers)
    ref, ours = _logprobs(exact, ids), _logprobs(llm, ids)
    kl = (ref.exp() * (ref - ours)).sum(-1).mean().item()  # KL(same weights in fp32 || bf16 products)
    assert kl < 1e-3


@pytest.mark.skipif(not packed_available(), reason="no C compiler: no decode stack")
@pytest.mark.parametrize("fmt", FORMATS[2:], ids=["int8", "int4"])
def test_the_decode_stack_runs_packed_layers_as_the_layers_do(tiny_model, fmt: dict) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    llm = LLM(str(path), num_blocks=32, **fmt)
    model = llm.engine.runner.model
    assert model.decode_stack is not None
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    stacked = llm.generate({"prompt_token_ids": [5, 9, 14]}, params, use_tqdm=False)[0].outputs[0]
    model.decode_stack = None
    layered = llm.generate({"prompt_token_ids": [5, 9, 14]}, params, use_tqdm=False)[0].outputs[0]
    assert stacked.token_ids == layered.token_ids
    for a, b in zip(stacked.logprobs, layered.logprobs, strict=True):
        for token in a:
            assert abs(a[token].logprob - b[token].logprob) < 1e-4


def test_a_bad_format_is_a_clear_error(tiny_model) -> None:
    path, _ = tiny_model("llama_gqa_tied")
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(path), quantization="int3")
    with pytest.raises(ValueError, match="quantization_group_size must be one of"):
        LLM(str(path), quantization="int4", quantization_group_size=48)
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(path), quantization="gguf")
