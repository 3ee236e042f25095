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
    "Gemma2ForCausalLM": (False, False),  # sandwich norms, soft-capping, sliding layers (models/gemma.py)
    "Gemma3ForCausalLM": (False, False),  # Gemma 2's layers with q/k norms and two RoPE bases
}
# Families that RMS-normalise each head's query and key before RoPE (a weight of head_dim each).
QK_NORM_ARCHITECTURES = {"Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"}
GEMMA_ARCHITECTURES = {"Gemma2ForCausalLM", "Gemma3ForCausalLM"}


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
    # Sliding-window attention: the layers listed attend to the last sliding_window positions
    # only (Mistral and Mixtral: every layer; Gemma: alternating with global layers).
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    attn_softcap: float | None = None  # Gemma 2: each score s becomes tanh(s / cap) * cap
    final_softcap: float | None = None  # Gemma 2: the logits likewise
    query_scale: float | None = None  # Gemma's query_pre_attn_scalar: scores scaled by its -1/2 power
    embed_scale: float = 1.0  # Gemma: the embedding times sqrt(hidden_size)
    norm_offset: float = 0.0  # Gemma's RMSNorm multiplies by (offset + w): added to w at load
    sandwich_norms: bool = False  # Gemma: norms on the attention's and the MLP's outputs too
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh" (Gemma)
    local_rope_theta: float | None = None  # Gemma 3: the sliding layers' own RoPE base (unscaled)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) must be in 1..{self.num_experts}")

    @property
    def longest_context(self) -> int:
        """The most positions the model can serve: its own, or dynamic NTK's stretch of them."""
        if self.rope_scaling is not None and self.rope_scaling["rope_type"] == "dynamic":
            return int(self.max_position_embeddings * float(self.rope_scaling["factor"]))
        return self.max_position_embeddings

    @property
    def attention_scale(self) -> float:
        return (self.query_scale or self.head_dim) ** -0.5

    @property
    def plain_layers(self) -> bool:
        """Whether every layer is the Llama block the C decode stack computes (windows aside:
        a window that does not bite changes nothing)."""
        extras = self.qk_norm or self.num_experts or self.attn_softcap or self.sandwich_norms
        return not extras and self.hidden_act == "silu" and self.local_rope_theta is None

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
        if arch == "Gemma2ForCausalLM" or arch == "Gemma3ForCausalLM":
            cfg = _gemma_rope(cfg)
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
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=arch in QK_NORM_ARCHITECTURES,
            rope_scaling=_rope_scaling(cfg),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            bos_token_id=cfg.get("bos_token_id"),
            **_moe_fields(cfg, arch),
            **_window_fields(cfg),
            **(_gemma_fields(cfg) if arch in GEMMA_ARCHITECTURES else {}),
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
    if kind == "default":
        return None
    original = scaling.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
    return {**scaling, "rope_type": kind, "original_max_position_embeddings": original}


def _window_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Which layers slide: transformers' layer_types where the config lists them; else every
    layer when a window is set (Mistral, Mixtral), unless use_sliding_window says no (Qwen2,
    whose older configs slide the layers from max_window_layers on)."""
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return {}
    layers = range(cfg["num_hidden_layers"])
    if cfg.get("layer_types"):
        sliding = tuple(i for i in layers if cfg["layer_types"][i] == "sliding_attention")
    elif cfg.get("use_sliding_window") and cfg.get("max_window_layers") is not None:
        sliding = tuple(i for i in layers if i >= cfg["max_window_layers"])
    else:
        sliding = tuple(layers)
    return dict(sliding_window=window, sliding_layers=sliding) if sliding else {}


def _gemma_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"Gemma hidden_activation {act!r} is not supported (gelu_pytorch_tanh is)")
    return dict(
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        query_scale=cfg.get("query_pre_attn_scalar"),
        embed_scale=cfg["hidden_size"] ** 0.5,
        norm_offset=1.0,
        sandwich_norms=True,
        hidden_act="gelu_tanh",
        local_rope_theta=cfg.get("rope_local_base_freq"),
    )


def _gemma_rope(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 keeps one RoPE per layer type (transformers 5: rope_parameters keyed by
    full_attention / sliding_attention; older files: rope_theta, rope_scaling and
    rope_local_base_freq): the global one becomes the model's, the local one its base."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" not in params:
        return cfg
    local = params.get("sliding_attention") or {}
    return {**cfg, "rope_parameters": params["full_attention"], "rope_local_base_freq": local.get("rope_theta")}


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (value,)
