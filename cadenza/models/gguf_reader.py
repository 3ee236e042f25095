"""Opening a GGUF file and reading its metadata (the model's config, the tokenizer's fields),
without torch: a process that never touches a weight (the gateway) reads them here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from cadenza.models.config import ModelConfig
from cadenza.models.gguf_families import gemma_fields, longrope_scaling
from cadenza.models.gguf_file import GGUFFile, read_gguf_file

# GGUF architecture -> HF architecture. Mistral files say "llama".
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def open_gguf(path: Path) -> GGUFFile:
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        return read_gguf_file(path)
    except Exception as e:  # garbage raises several types (struct, unicode, enum); report them as one
        raise ValueError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})") from e


def field_value(reader: GGUFFile, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None else value


def read_gguf_config(reader: GGUFFile, path: Path) -> ModelConfig:
    arch = field_value(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(_ARCHITECTURES)}")

    def meta(key: str, default: Any = None) -> Any:
        return field_value(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    names = {t.name for t in reader.tensors}
    experts = meta("expert_count", 0)
    return ModelConfig(
        # Mixtral files say "llama" too: experts tell them apart.
        architecture="MixtralForCausalLM" if arch == "llama" and experts else _ARCHITECTURES[arch],
        vocab_size=meta("vocab_size") or len(field_value(reader, "tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=meta("feed_forward_length"),
        num_layers=meta("block_count"),
        num_heads=heads,
        num_kv_heads=meta("attention.head_count_kv") or heads,
        head_dim=meta("attention.key_length") or hidden // heads,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta("rope.freq_base", 10000.0),
        max_position_embeddings=meta("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rope_scaling=longrope_scaling(reader, meta) if arch == "phi3" else _rope_scaling(meta),
        rope_freq_factors=_freq_factors(reader),
        eos_token_ids=_eos_ids(reader),
        bos_token_id=field_value(reader, "tokenizer.ggml.bos_token_id"),
        **_moe_fields(meta, experts, names),
        **(gemma_fields(arch, meta, hidden, heads, meta("block_count")) if arch.startswith("gemma") else {}),
        **({} if arch.startswith("gemma") else _window(meta)),
    )


def _moe_fields(meta: Any, experts: int, names: set[str]) -> dict[str, Any]:
    """llama.cpp's expert keys; its Mixtral and Qwen3-MoE both renormalise the chosen weights.
    A layer without a router is a dense one."""
    if not experts:
        return {}
    layers = range(meta("block_count"))
    return dict(
        dense_layers=tuple(i for i in layers if f"blk.{i}.ffn_gate_inp.weight" not in names),
        num_experts=experts,
        experts_per_token=meta("expert_used_count"),
        moe_intermediate_size=meta("expert_feed_forward_length") or meta("feed_forward_length"),
        renormalize_experts=bool(meta("expert_weights_norm", True)),
    )


def _window(meta: Any) -> dict[str, Any]:
    """A sliding window the file states (Mistral's, under arch llama) covers every layer."""
    window = meta("attention.sliding_window")
    return dict(sliding_window=window, sliding_layers=tuple(range(meta("block_count")))) if window else {}


def _rope_scaling(meta: Any) -> dict[str, Any] | None:
    kind = meta("rope.scaling.type")
    if kind in (None, "none"):
        return None
    return {"rope_type": kind, "factor": meta("rope.scaling.factor", 1.0)}


def _freq_factors(reader: GGUFFile) -> tuple[float, ...] | None:
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            return tuple(float(x) for x in np.asarray(t.data, dtype=np.float32))
    return None


def _eos_ids(reader: GGUFFile) -> tuple[int, ...]:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    ids = [field_value(reader, k) for k in keys]
    return tuple(dict.fromkeys(i for i in ids if i is not None))
