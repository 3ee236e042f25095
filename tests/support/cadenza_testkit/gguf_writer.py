"""GGUF files written from tiny transformers models, as llama.cpp's converter lays them out:
Llama's Q/K rows permuted, experts stacked, Gemma's norms with the 1 folded in and its extra
norms under llama.cpp's names, Phi-3's fused projections and longrope factor tensors."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from cadenza.models.tokenizer import _byte_alphabet

Q = gguf.GGMLQuantizationType
RAW_TYPES = {Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS, Q.IQ3_S, Q.TQ2_0}  # gguf cannot quantize these
_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.qkv_proj": "attn_qkv",  # Phi-3
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",  # Phi-3: gate and up stay fused under ffn_up
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}
# Gemma's norms: the attention's output norm, and the MLP's input (ffn_norm) and output norms.
_GEMMA_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf: str, gemma: bool = False) -> str:
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
    names = {**_NAMES, **_GEMMA_NAMES} if gemma else _NAMES
    return f"blk.{layer}.{names[module]}.{kind}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert-time row order for Q and K."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope(cfg: object) -> dict:
    """The global RoPE parameters (Gemma 3 keeps one set per layer type)."""
    params = getattr(cfg, "rope_parameters", None) or {}
    return params.get("full_attention", params)


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
    w.add_rope_freq_base(_rope(cfg).get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(list(_byte_alphabet().values())[: cfg.vocab_size])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    _family_metadata(w, cfg, arch)
    for gguf_key, array in gguf_arrays(model, arch).items():
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


def _family_metadata(w: gguf.GGUFWriter, cfg: object, arch: str) -> None:
    """Experts, Gemma's window and soft-caps, Phi-3's longrope keys (its factors are tensors)."""
    if getattr(cfg, "num_local_experts", None):
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)
        if hasattr(cfg, "norm_topk_prob"):  # Qwen3-MoE's; Mixtral always renormalises
            w.add_expert_weights_norm(cfg.norm_topk_prob)
    if getattr(cfg, "sliding_window", None):
        w.add_sliding_window(cfg.sliding_window)
    if getattr(cfg, "query_pre_attn_scalar", None):  # GGUF's attention.scale key
        w.add_float32(f"{arch}.attention.scale", cfg.query_pre_attn_scalar**-0.5)
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(cfg, key, None) is not None:
            w.add_float32(f"{arch}.{key}", getattr(cfg, key))
    rope = _rope(cfg)
    if rope.get("rope_type") == "longrope":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])


def gguf_arrays(model: torch.nn.Module, arch: str) -> dict[str, np.ndarray]:
    """GGUF name -> array in llama.cpp's layout: Llama's Q/K rows permuted; a routed layer's
    experts (transformers holds them fused, [E, 2I, H] gate|up and [E, H, I]) as the
    ffn_gate_exps / ffn_up_exps / ffn_down_exps stacks; Gemma's norms as (1 + w); Phi-3's
    longrope factors as tensors."""
    cfg, arrays = model.config, {}
    gemma = arch.startswith("gemma")
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
        if "rotary_emb" in name:
            continue
        if ".q_proj." in name and arch == "llama":
            array = permute(array, cfg.num_attention_heads)
        if ".k_proj." in name and arch == "llama":
            array = permute(array, cfg.num_key_value_heads)
        if gemma and name.endswith("norm.weight"):
            array = array + 1.0
        arrays[gguf_name(name, gemma)] = array
    rope = _rope(cfg)
    if rope.get("rope_type") == "longrope":
        arrays["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        arrays["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return arrays
