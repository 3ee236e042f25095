"""What each family adds to the Llama decoder, at the edges: Phi-3's fused checkpoint tensors
split by name, and what a family asks for that Cadenza refuses by name rather than running
wrong. (Logits, decode steps and TP/PP slices of every family against transformers live in
test_logits_vs_hf.py, test_decode_vs_hf.py and test_rank_slice.py.)"""

from __future__ import annotations

import pytest
import torch

from cadenza.models.config import ModelConfig
from cadenza.models.fused_checkpoint import split_fused

PHI3 = {
    "architectures": ["Phi3ForCausalLM"],
    "vocab_size": 160,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_fused_tensors_split_into_the_names_other_families_use() -> None:
    cfg = ModelConfig.from_hf(PHI3)
    qkv, gate_up = torch.arange(128 * 64.0).view(128, 64), torch.arange(192 * 64.0).view(192, 64)
    tensors = [("model.layers.0.self_attn.qkv_proj.weight", qkv), ("model.layers.0.mlp.gate_up_proj.weight", gate_up)]
    got = dict(split_fused(iter(tensors), cfg))
    assert [n.split(".", 3)[3] for n in got] == [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
    ]
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], qkv[64:96])
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], gate_up[96:])


def test_a_fused_tensor_of_the_wrong_size_is_named() -> None:
    cfg = ModelConfig.from_hf(PHI3)
    with pytest.raises(ValueError, match=r"qkv_proj.weight: 100 rows, expected 128 \(64 \+ 32 \+ 32\)"):
        list(split_fused(iter([("model.layers.0.self_attn.qkv_proj.weight", torch.zeros(100, 64))]), cfg))


def test_partial_rotary_embeddings_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75 is not supported"):
        ModelConfig.from_hf({**PHI3, "partial_rotary_factor": 0.75})
