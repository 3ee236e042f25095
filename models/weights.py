"""Build a model and fill it from HF-named tensors, whatever file format they came from."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from cadenza.models.config import ModelConfig
from cadenza.models.llama import LlamaForCausalLM
from cadenza.models.rope import cos_sin_cache

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = ("rotary_emb.inv_freq",)


def build_model(
    cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, device: str, max_positions: int
) -> LlamaForCausalLM:
    """Allocate without initialising (meta device), then copy every weight exactly once."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model = model.to_empty(device=device).to(dtype)
    model.cos_sin = cos_sin_cache(cfg, max_positions).to(device)
    filled: set[str] = set()
    for name, tensor in tensors:
        _load_one(model, cfg, name, tensor, filled)
    _check_complete(model, filled)
    return model.eval()


def _load_one(model: LlamaForCausalLM, cfg: ModelConfig, name: str, tensor: torch.Tensor, filled: set[str]) -> None:
    if name.endswith(_IGNORED) or (name == "lm_head.weight" and cfg.tie_word_embeddings):
        return
    _copy(model, cfg, name, tensor)
    if name == "model.embed_tokens.weight" and cfg.tie_word_embeddings:
        _copy(model, cfg, "lm_head.weight", tensor)
    filled.add(name)


def _copy(model: LlamaForCausalLM, cfg: ModelConfig, name: str, tensor: torch.Tensor) -> None:
    target, offset = _target(model, cfg, name)
    # Linear weights live transposed ([in, out]); viewing them as [out, in] keeps HF's row offsets.
    view = target.data.t() if target.dim() == 2 and name != "model.embed_tokens.weight" else target.data
    destination = view if offset is None else view[offset : offset + tensor.shape[0]]
    if destination.shape != tensor.shape:
        raise ValueError(f"weight {name}: expected shape {tuple(destination.shape)}, got {tuple(tensor.shape)}")
    destination.copy_(tensor)


def _target(model: LlamaForCausalLM, cfg: ModelConfig, name: str) -> tuple[torch.Tensor, int | None]:
    """The parameter an HF tensor goes to, and its row offset inside a fused one."""
    top = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm}
    if name in top:
        return top[name], None
    if name == "lm_head.weight":
        return model.lm_head.weight_t, None
    match = _LAYER.fullmatch(name)
    if not match or int(match.group(1)) >= cfg.num_layers:
        raise ValueError(f"unexpected weight {name!r}")
    layer, rest = model.layers[int(match.group(1))], match.group(2)
    return _layer_target(layer, cfg, rest, name)


def _layer_target(layer: torch.nn.Module, cfg: ModelConfig, rest: str, name: str) -> tuple[torch.Tensor, int | None]:
    proj, _, kind = rest.rpartition(".")
    attn, mlp = layer.self_attn, layer.mlp
    fused = {
        "self_attn.q_proj": (attn.qkv_proj, 0),
        "self_attn.k_proj": (attn.qkv_proj, cfg.q_size),
        "self_attn.v_proj": (attn.qkv_proj, cfg.q_size + cfg.kv_size),
        "mlp.gate_proj": (mlp.gate_up_proj, 0),
        "mlp.up_proj": (mlp.gate_up_proj, cfg.intermediate_size),
        "self_attn.o_proj": (attn.o_proj, None),
        "mlp.down_proj": (mlp.down_proj, None),
    }
    attribute = "weight_t" if kind == "weight" else kind
    if proj in fused and getattr(fused[proj][0], attribute, None) is not None:
        module, offset = fused[proj]
        return getattr(module, attribute), offset
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return getattr(layer, rest.split(".")[0]), None
    raise ValueError(f"unexpected weight {name!r}")


def _check_complete(model: LlamaForCausalLM, filled: set[str]) -> None:
    """Every expected HF tensor must have arrived; a missing one would leave garbage memory."""
    cfg = model.cfg
    expected = {"model.embed_tokens.weight", "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        expected.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        expected |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
        expected |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if cfg.qkv_bias:
            expected |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
        if cfg.o_bias:
            expected.add(p + "self_attn.o_proj.bias")
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
