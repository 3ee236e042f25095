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


def test_dynamic_ntk_is_plain_within_the_context_and_one_stretched_base_beyond(tmp_path) -> None:  # noqa: ANN001
    """Dynamic NTK against transformers: a 60-token sequence within the model's 64 positions
    turns at the plain base (max_model_len 64, the default); served up to 100 positions, the
    whole cache takes the base transformers computes for a sequence that long."""
    import transformers
    from cadenza_testkit.hf_oracle import hf_logprobs, our_prompt_logprobs, worst_full_distribution_diff

    from cadenza import LLM

    config = transformers.LlamaConfig(
        vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    assert ModelConfig.from_hf(config.to_dict() | {"architectures": ["LlamaForCausalLM"]}).longest_context == 128
    ids = torch.randint(0, 160, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    for length, max_model_len in ((60, None), (100, 101)):
        llm = LLM(str(tmp_path), num_blocks=32, max_logprobs=-1, max_model_len=max_model_len)
        ours = our_prompt_logprobs(llm, ids[:length], k=160)
        hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path).eval()  # fresh: its cache grows once
        assert worst_full_distribution_diff(ours, hf_logprobs(hf_model, ids[:length]), 160) <= 1e-3, length


def test_gemma_configs_read_their_layer_kinds_and_rope_bases() -> None:
    gemma3 = {
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 160, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "sliding_window": 512, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    }  # fmt: skip
    cfg = ModelConfig.from_hf(gemma3)
    assert (cfg.sliding_window, cfg.sliding_layers) == (512, (0, 1, 2, 3, 4))
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling["rope_type"]) == (1e6, 1e4, "linear")
    assert (cfg.qk_norm, cfg.sandwich_norms, cfg.norm_offset, cfg.embed_scale) == (True, True, 1.0, 8.0)
    assert cfg.attention_scale == 16**-0.5 and not cfg.plain_layers
    with pytest.raises(ValueError, match="hidden_activation 'relu' is not supported"):
        ModelConfig.from_hf({**gemma3, "hidden_activation": "relu"})
