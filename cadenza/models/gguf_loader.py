"""GGUF files: config from metadata, tensors under HF names and layouts, kept in their
stored format (kernels/quant/gguf_blocks.py) or dequantized to fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import torch

from cadenza.kernels.quant.gguf_blocks import KEPT_TYPES, packed_from_gguf
from cadenza.kernels.quant.weight import PackedWeight
from cadenza.models.config import ModelConfig
from cadenza.models.gguf_file import GGUFFile, GGUFTensor
from cadenza.models.gguf_reader import field_value, open_gguf, read_gguf_config  # noqa: F401 - this module's API
from cadenza.models.moe import expert_weight_name

Q = gguf.GGMLQuantizationType
# Types gguf's numpy dequantizer handles and we test or trust; anything else is refused by name.
# The low-bit K and i-quants (EXPANDED_ONLY) are expanded to `dtype` on load: no kernel reads them
# packed, so they cost memory like the dense model, and serve the user who only has that file.
EXPANDED_ONLY = {Q.Q2_K, Q.Q3_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS}
SUPPORTED_TYPES = {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, *EXPANDED_ONLY}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Gemma's four norms: llama.cpp calls the MLP's input norm ffn_norm, as Llama's one second norm.
_GEMMA_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Phi-3's fused projections keep their fused names (models/fused_checkpoint.py splits them).
_PHI3_NAMES = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_SKIPPED = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def iter_gguf_tensors(
    reader: GGUFFile, cfg: ModelConfig, path: Path, keep: bool = False
) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """HF-named tensors: fp32, or with `keep` every 2-D tensor of a type in KEPT_TYPES as a
    PackedWeight of its stored bytes. llama.cpp permutes Llama's Q/K rows for its RoPE; undo
    that here (on the rows, which blocks never cross)."""
    # llama.cpp permutes Llama's (and Mistral's and Mixtral's) only
    permuted = cfg.architecture in ("LlamaForCausalLM", "MixtralForCausalLM")
    for t in reader.tensors:
        if t.name in _SKIPPED:  # RoPE factors: read into the config (gguf_reader.py)
            continue
        if t.tensor_type not in SUPPORTED_TYPES:
            raise ValueError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}")
        if t.name.endswith("_exps.weight") or ".ffn_gate_inp." in t.name:
            yield from _expert_tensors(t, cfg, keep)
            continue
        name = hf_name(t.name, path, _family_names(cfg))
        heads = None
        if permuted and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_heads if ".attn_q." in t.name else cfg.num_kv_heads
        shape = tuple(int(d) for d in reversed(t.shape))
        if keep and len(shape) == 2 and t.tensor_type.name in KEPT_TYPES:
            packed = packed_from_gguf(t.tensor_type.name, t.data, *shape)
            yield name, packed if heads is None else packed.take_rows(unpermute_index(shape[0], heads))
            continue
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        if heads is not None:
            array = unpermute_rows(array, heads)
        yield name, torch.from_numpy(np.array(array, copy=True))


def _expert_tensors(t: GGUFTensor, cfg: ModelConfig, keep: bool) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """A routed layer's router, or one of its [E, rows, cols] expert tensors as E tensors under
    the per-expert names (views of one packed weight when kept: its rows are the experts' rows)."""
    _, layer, kind, _ = t.name.split(".")
    prefix = f"model.layers.{layer}."
    shape = tuple(int(d) for d in reversed(t.shape))
    if kind == "ffn_gate_inp":
        array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
        yield expert_weight_name(cfg, prefix, -1, "router"), torch.from_numpy(np.array(array, copy=True))
        return
    role = kind.removeprefix("ffn_").removesuffix("_exps")
    experts, rows, cols = shape
    if keep and t.tensor_type.name in KEPT_TYPES:
        packed = packed_from_gguf(t.tensor_type.name, t.data, experts * rows, cols)
        for e in range(experts):
            yield expert_weight_name(cfg, prefix, e, role), packed.row_view(e * rows, (e + 1) * rows)
        return
    array = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(shape)
    for e in range(experts):
        yield expert_weight_name(cfg, prefix, e, role), torch.from_numpy(np.array(array[e], copy=True))


def unpermute_index(rows: int, num_heads: int) -> torch.Tensor:
    """The row order unpermute_rows produces, as indices into the stored rows."""
    return torch.from_numpy(unpermute_rows(np.arange(rows), num_heads).copy())


def unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's convert-time permute: [h, half, 2, ...] back to [h, 2, half, ...]."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _family_names(cfg: ModelConfig) -> dict[str, str]:
    if cfg.sandwich_norms:
        return {**_LAYER_NAMES, **_GEMMA_NAMES}
    if cfg.architecture == "Phi3ForCausalLM":
        return {**_LAYER_NAMES, **_PHI3_NAMES}
    return _LAYER_NAMES


def hf_name(name: str, path: Path, layer_names: dict[str, str] = _LAYER_NAMES) -> str:
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    raise ValueError(f"{path}: unexpected tensor {name!r}")
