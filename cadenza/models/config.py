"""ModelConfig: the shape of a Llama-family decoder, from HF config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> (q/k/v bias, o_proj bias). Qwen2 biases q/k/v only.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, False),
    "Phi3ForCausalLM": (False, False),  # q/k/v and gate/up stored fused (models/fused_checkpoint.py)
    "MixtralForCausalLM": (False, False),  # routed experts in every layer (models/moe.py)
    "Qwen3MoeForCausalLM": (False, False),  # Qwen3 attention, routed experts (models/moe.py)
}
# Families that RMS-normalise each head's query and key before RoPE (a weight of head_dim each).
QK_NORM_ARCHITECTURES = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM"}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # q_norm / k_norm per head before RoPE (Qwen3)
    rope_scaling: dict[str, Any] | None = None
    # llama.cpp stores llama3-style scaling as per-frequency divisors instead of parameters.
    rope_freq_factors: tuple[float, ...] | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    bos_token_id: int | None = None
    # Mixture of experts (0 experts: every layer a dense MLP). Each routed layer sends a token
    # to its experts_per_token best experts of num_experts, each an MLP of moe_intermediate_size.
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    # Renormalise the chosen experts' softmax weights to sum to 1 (Mixtral always; Qwen3-MoE's
    # norm_topk_prob).
    renormalize_experts: bool = True
    # Qwen3-MoE: layer i is routed when (i + 1) % sparse_step == 0 and i is not listed dense.
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be in 1..{self.num_experts}")

    def is_moe_layer(self, index: int) -> bool:
        return self.num_experts > 0 and (index + 1) % self.sparse_step == 0 and index not in self.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """From a parsed HF config.json; `source` names the file in errors."""
        arch = (cfg.get("architectures") or ["?"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{source}: unsupported architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        qkv_bias, o_bias = SUPPORTED_ARCHITECTURES[arch]
        if cfg.get("attention_bias"):  # Llama's flag puts a bias on all four projections
            qkv_bias = o_bias = True
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(
                f"{source}: partial_rotary_factor {cfg['partial_rotary_factor']} is not supported (RoPE on every dim)"
            )
        heads = cfg["num_attention_heads"]
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(cfg),
            max_position_embeddings=_context_length(cfg),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            rope_scaling=_rope_scaling(cfg),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            **_moe_fields(cfg, arch),
        )


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Mixtral's and Qwen3-MoE's spellings of the expert layout (none for dense models).
    transformers 5 writes num_local_experts for both; Qwen3-MoE's own files say num_experts."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 0
    if not experts:
        return {}
    mixtral = arch == "MixtralForCausalLM"
    return dict(
        num_experts=experts,
        experts_per_token=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"],
        renormalize_experts=True if mixtral else bool(cfg.get("norm_topk_prob", False)),
        sparse_step=1 if mixtral else cfg.get("decoder_sparse_step", 1),
        dense_layers=() if mixtral else tuple(cfg.get("mlp_only_layers") or ()),
    )


def _rope_theta(cfg: dict[str, Any]) -> float:
    params = cfg.get("rope_parameters") or {}
    return float(cfg.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """transformers 5 folds rope_scaling into rope_parameters; accept both spellings."""
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return None if kind == "default" else {**scaling, "rope_type": kind}


def _context_length(cfg: dict[str, Any]) -> int:
    """Mistral-style sliding windows are not implemented, so never run past the window."""
    length = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    return min(length, window) if window else length


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
