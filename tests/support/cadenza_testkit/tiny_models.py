"""Tiny random HF checkpoints (built and saved by the tests) and a tiny model shape."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cadenza.models.config import ModelConfig

TINY = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512)

# name -> (transformers config class, extra config fields)
TINY_CONFIGS = {
    "llama_mha": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False)),
    "llama_gqa_tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_mqa": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)),
    "qwen2_gqa_bias": (
        "Qwen2Config",
        dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=False, head_dim=16, hidden_size=96),
    ),
    "qwen3_qk_norm": (
        "Qwen3Config",
        dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, head_dim=32, hidden_size=64),
    ),
    "phi3_fused": (
        "Phi3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),  # Phi-3 stores q/k/v and gate/up fused in its checkpoint
    "mistral_gqa": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False),
    ),
    "llama_yarn": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
        ),
    ),
    # Phi-3's longrope: the tests' sequences are all longer than the original 16 positions,
    # where transformers (and, for a 512-position context, Cadenza) take the long factors.
    "phi3_longrope": (
        "Phi3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            pad_token_id=0,
            original_max_position_embeddings=16,
            rope_parameters=dict(
                rope_type="longrope",
                rope_theta=10000.0,
                long_factor=[1.0 + 0.25 * i for i in range(8)],
                short_factor=[1.0 + 0.05 * i for i in range(8)],
                original_max_position_embeddings=16,
            ),
        ),
    ),
    "llama3_rope": (
        "LlamaConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=64,
            ),
        ),
    ),
    # Routed experts: Mixtral (softmax top-2, renormalised) and Qwen3-MoE (q/k norms, no
    # renormalisation, a dense layer among the routed ones).
    "mixtral_moe": (
        "MixtralConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
        ),
    ),  # fmt: skip
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),  # fmt: skip
    # Sliding windows shorter than the tests' prompts, so they bite: Mistral on every layer;
    # Gemma 2 alternating with global layers, soft-capped scores and logits; Gemma 3 with q/k
    # norms and its sliding layers on a RoPE base of their own.
    "mistral_sliding": (
        "MistralConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, sliding_window=16, tie_word_embeddings=False),
    ),
    "gemma2_sliding": (
        "Gemma2Config",
        dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12),
    ),
    "gemma3_sliding": (
        "Gemma3TextConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=12,
            num_hidden_layers=6,  # Gemma 3's pattern: five sliding layers, then a global one
            architectures=["Gemma3ForCausalLM"],
        ),
    ),
}


def build_tiny_hf(kind: str, directory: Path, seed: int = 0) -> torch.nn.Module:
    """A random-weight HF model saved as an HF directory; weights scaled up so logits are peaked."""
    import transformers

    cls_name, extra = TINY_CONFIGS[kind]
    config = getattr(transformers, cls_name)(**{**TINY, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if "norm" in name else 0.15) + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(directory)
    return model


# A model shape for pool-sizing arithmetic (no weights): 2 layers, 4 heads over 2 KV heads of 16.
POOL_MODEL = ModelConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16, 1e-5, 1e4, 512, False)


def build_tiny_chat_model(directory: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved in `directory`:
    fast to load twice."""
    import torch
    import transformers

    from cadenza.models.loader import DEFAULT_MODEL, load_tokenizer, read_model

    tok = load_tokenizer(*read_model(DEFAULT_MODEL))
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok.backend.save(str(directory / "tokenizer.json"))
    eos = tok.id_to_token(tok.eos_token_ids[0])
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": tok.chat_template, "eos_token": eos}))
    return directory
