"""The context sweep's bounds: the FLOPs it charges a prompt are the model's own."""

from __future__ import annotations

import pytest

from cadenza.benchmarks.context_sweep import prefill_flops, projection_params
from cadenza.models.loader import read_model


@pytest.mark.parametrize("kind", ["llama_gqa_tied", "qwen2_gqa_bias", "llama_mqa"])
def test_projection_params_are_the_layers_weights(tiny_model, kind: str) -> None:
    path, hf = tiny_model(kind)
    _, cfg = read_model(str(path))
    layers = hf.model.layers
    expected = sum(m.weight.numel() for layer in layers for m in layer.modules() if hasattr(m, "in_features"))
    assert projection_params(cfg) == expected


def test_prefill_flops_count_causal_pairs(tiny_model) -> None:
    _, cfg = read_model(str(tiny_model("llama_gqa_tied")[0]))
    one, four = prefill_flops(cfg, 1), prefill_flops(cfg, 4)
    per_pair = 4 * cfg.head_dim * cfg.num_heads * cfg.num_layers
    assert one["attention_flops"] == per_pair and four["attention_flops"] == 10 * per_pair  # 1 + 2 + 3 + 4
    head = 2 * cfg.vocab_size * cfg.hidden_size  # once: only the last position is sampled
    assert four["gemm_flops"] - head == 4 * (one["gemm_flops"] - head)
