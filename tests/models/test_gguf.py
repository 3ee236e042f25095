"""GGUF loading: each supported tensor type and the Q/K permutation, against transformers'
own GGUF loader on the same file; clear errors for what is unsupported."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from cadenza import LLM, SamplingParams
from cadenza.models.tokenizer import _byte_alphabet

Q = gguf.GGMLQuantizationType
RAW_TYPES = {Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ3_S, Q.TQ2_0}  # gguf cannot quantize these
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def gguf_name(hf: str) -> str:
    if ".mlp.gate." in hf:  # a routed layer's router
        return f"blk.{hf.split('.')[2]}.ffn_gate_inp.weight"
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    _, _, layer, *rest = hf.split(".")
    module, kind = ".".join(rest[:-1]), rest[-1]
    return f"blk.{layer}.{_NAMES[module]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert-time row order for Q and K."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model: torch.nn.Module, path: Path, qtype: Q, override: dict[str, Q] | None = None, arch: str = "llama"
) -> Path:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    if getattr(cfg, "head_dim", None):
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base((getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(_byte_alphabet().values())[: cfg.vocab_size])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if getattr(cfg, "num_local_experts", None):
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
        if hasattr(cfg, "norm_topk_prob"):  # Qwen3-MoE's; Mixtral always renormalises
            w.add_expert_weights_norm(cfg.norm_topk_prob)
    for gguf_key, array in _gguf_arrays(model, arch).items():
        kind = (override or {}).get(gguf_key, Q.F32 if array.ndim == 1 else qtype)
        if kind == Q.F32:
            w.add_tensor(gguf_key, np.ascontiguousarray(array))
        elif kind in RAW_TYPES:  # no quantizer in gguf: random blocks of the right size
            block, size = gguf.GGML_QUANT_SIZES[kind]
            raw = np.random.default_rng(0).integers(0, 256, (array.shape[0], array.shape[1] // block * size))
            w.add_tensor(gguf_key, raw.astype(np.uint8), raw_dtype=kind)
        else:
            w.add_tensor(gguf_key, gguf.quants.quantize(np.ascontiguousarray(array), kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _gguf_arrays(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: Llama's Q/K rows permuted; a routed layer's
    experts (transformers holds them fused, [E, 2I, H] gate|up and [E, H, I]) as the
    ffn_gate_exps / ffn_up_exps / ffn_down_exps stacks."""
    cfg, arrays = model.config, {}
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name.endswith("experts.gate_up_proj"):
            layer, half = name.split(".")[2], array.shape[1] // 2
            arrays[f"blk.{layer}.ffn_gate_exps.weight"] = array[:, :half]
            arrays[f"blk.{layer}.ffn_up_exps.weight"] = array[:, half:]
            continue
        if name.endswith("experts.down_proj"):
            arrays[f"blk.{name.split('.')[2]}.ffn_down_exps.weight"] = array
            continue
        if ".q_proj." in name and arch == "llama":
            array = permute(array, cfg.num_attention_heads)
        if ".k_proj." in name and arch == "llama":
            array = permute(array, cfg.num_key_value_heads)
        arrays[gguf_name(name)] = array
    return arrays


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


@pytest.mark.parametrize("kind,arch", [("mixtral_moe", "llama"), ("qwen3_moe", "qwen3moe")])
def test_a_moe_gguf_matches_its_hf_directory(tiny_model, tmp_path: Path, kind: str, arch: str) -> None:
    """Experts stored as llama.cpp stores them ([E, rows, cols] per layer and role, a router
    per layer; Mixtral's under arch llama): F32 against the HF directory, and Q8_0 kept packed
    (each expert a row view of its stack) against the same file expanded."""
    directory, hf = tiny_model(kind)
    ids = torch.randint(3, 160, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=1, prompt_logprobs=5)
    for qtype in (Q.F32, Q.Q8_0):
        path = write_gguf(hf, tmp_path / f"{kind}-{qtype.name}.gguf", qtype, arch=arch)
        llm = LLM(str(path), num_blocks=32)
        assert llm.engine.model_config.num_experts == 4
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
