"""GGUF loading: each supported tensor type and the Q/K permutation, against transformers'
own GGUF loader on the same file; clear errors for what is unsupported."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from cadenza_testkit.gguf_writer import write_gguf

from cadenza import LLM, SamplingParams
from cadenza.models.config import ModelConfig

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_tensor_types_match_transformers(tiny_model, tmp_path: Path, qtype: Q) -> None:
    from transformers import AutoModelForCausalLM

    _, hf = tiny_model("llama_gqa_tied")
    path = write_gguf(hf, tmp_path / f"tiny-{qtype.name}.gguf", qtype)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    ids = torch.randint(3, 160, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    llm = LLM(str(path), num_blocks=32, max_model_len=256)
    ours = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=5), use_tqdm=False)
    with torch.no_grad():
        expected = torch.log_softmax(ref(torch.tensor([ids])).logits[0], -1)
    for pos, position in enumerate(ours[0].prompt_logprobs[1:]):
        for token, lp in position.items():
            assert abs(lp.logprob - float(expected[pos, token])) <= 1e-3


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_a_qwen3_gguf_matches_its_hf_directory(tiny_model, tmp_path: Path, qtype: Q) -> None:
    """arch qwen3: q/k norms (attn_q_norm, attn_k_norm), a head_dim of its own (key_length), no
    Q/K row permutation. F32 against the HF directory (itself held to transformers); Q8_0 kept
    packed against the same file expanded to fp32."""
    directory, hf = tiny_model("qwen3_qk_norm")
    path = write_gguf(hf, tmp_path / f"qwen3-{qtype.name}.gguf", qtype, arch="qwen3")
    ids = torch.randint(3, 160, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    llm = LLM(str(path), num_blocks=32)
    assert llm.engine.model_config.qk_norm
    reference = LLM(str(directory) if qtype == Q.F32 else str(path), num_blocks=32, quantization="none")
    ours = llm.generate({"prompt_token_ids": ids}, params)
    ref = reference.generate({"prompt_token_ids": ids}, params)
    for pos, (got, want) in enumerate(zip(ours[0].prompt_logprobs[1:], ref[0].prompt_logprobs[1:])):
        token = ids[pos + 1]  # the prompt's own token is always among a position's logprobs
        assert abs(got[token].logprob - want[token].logprob) <= 1e-3


FAMILIES = [
    ("mixtral_moe", "llama"),
    ("qwen3_moe", "qwen3moe"),
    ("mistral_sliding", "llama"),
    ("gemma2_sliding", "gemma2"),
    ("gemma3_sliding", "gemma3"),
    ("phi3_longrope", "phi3"),
]


@pytest.mark.parametrize("kind,arch", FAMILIES)
def test_each_familys_gguf_matches_its_hf_directory(tiny_model, tmp_path: Path, kind: str, arch: str) -> None:
    """Each family as llama.cpp's converter writes it: experts as [E, rows, cols] stacks and a
    router per layer (Mixtral under arch llama, told apart by expert_count); Gemma's norms
    with their 1 folded in, its extra norms, window and soft-caps; Phi-3's fused projections
    and longrope factor tensors. F32 against the HF directory, and Q8_0 kept packed against
    the same file expanded."""
    directory, hf = tiny_model(kind)
    ids = torch.randint(3, 160, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    expected = ModelConfig.from_hf(json.loads((directory / "config.json").read_text()))
    for qtype in (Q.F32, Q.Q8_0):
        path = write_gguf(hf, tmp_path / f"{kind}-{qtype.name}.gguf", qtype, arch=arch)
        llm = LLM(str(path), num_blocks=32)
        got = llm.engine.model_config
        assert (got.num_experts, got.sliding_window, got.sliding_layers) == (
            expected.num_experts,
            expected.sliding_window,
            expected.sliding_layers,
        )
        if expected.architecture != "MistralForCausalLM":  # Mistral's files say llama
            assert got.architecture == expected.architecture
        reference = LLM(str(directory) if qtype == Q.F32 else str(path), num_blocks=32, quantization="none")
        ours = llm.generate({"prompt_token_ids": ids}, params)[0].prompt_logprobs[1:]
        ref = reference.generate({"prompt_token_ids": ids}, params)[0].prompt_logprobs[1:]
        for pos, (got, want) in enumerate(zip(ours, ref, strict=True)):
            token = ids[pos + 1]
            assert abs(got[token].logprob - want[token].logprob) <= 1e-3, (qtype.name, pos)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random blocks hold NaN and inf scales
@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ3_S])
def test_low_bit_types_are_expanded_by_ggufs_own_dequantizer(tiny_model, tmp_path: Path, qtype: Q) -> None:
    """Q2_K, Q3_K and the i-quants load, each tensor exactly as gguf's dequantizer expands it
    (blocks of 256 values: the tiny model's 160-wide rows are padded out in a model of 256)."""
    from cadenza.models.gguf_loader import iter_gguf_tensors, open_gguf, read_gguf_config

    hf = _wide_llama(tmp_path)
    path = write_gguf(hf, tmp_path / f"low-{qtype.name}.gguf", Q.F32, override={"blk.0.ffn_up.weight": qtype})
    reader = open_gguf(path)
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    expected = gguf.quants.dequantize(raw.data, qtype).reshape(512, 256)
    got = dict(iter_gguf_tensors(reader, read_gguf_config(reader, path), path))["model.layers.0.mlp.up_proj.weight"]
    assert got.shape == (512, 256) and np.array_equal(got.numpy(), expected, equal_nan=True)


def _wide_llama(directory: Path) -> torch.nn.Module:
    """A tiny Llama whose rows are one K-quant super-block (256) wide."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=160, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_unsupported_tensor_type_is_named(tiny_model, tmp_path: Path) -> None:
    _, hf = tiny_model("llama_gqa_tied")
    path = write_gguf(hf, tmp_path / "tq.gguf", Q.F32, override={"blk.0.ffn_up.weight": Q.TQ2_0})
    with pytest.raises(ValueError, match=r"tq\.gguf: tensor blk\.0\.ffn_up\.weight has unsupported type TQ2_0"):
        LLM(str(path))


def test_gguf_config_and_tokenizer(smollm) -> None:
    cfg = smollm.engine.model_config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152
    assert smollm.get_tokenizer().eos_token_ids == (2,)
