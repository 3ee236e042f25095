"""Build a model and fill it from HF-named tensors, whatever file format they came from.

Tensors arrive dense (torch tensors) or packed (kernels.quant PackedWeight: a GGUF's blocks
kept as stored). A projection's dense weight is allocated only when its first dense part
arrives, so a packed file never holds an fp32 copy of its projections; packed parts of a
fused projection (q|k|v, gate|up) are stacked once all have arrived.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from cadenza.kernels.quant.weight import PackedWeight, cat_rows
from cadenza.models.config import ModelConfig
from cadenza.models.families import model_class
from cadenza.models.linear import Linear
from cadenza.models.llama import LlamaForCausalLM
from cadenza.models.moe import SparseMoE, moe_weight_names
from cadenza.models.rank_slice import EMBED, RankSlicer
from cadenza.models.rope import cos_sin_cache, local_cos_sin_cache
from cadenza.models.shard import shard_model, stage_layers
from cadenza.models.tp import TPGroup
from cadenza.weight_format import WeightFormat

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_IGNORED = ("rotary_emb.inv_freq",)
Loaded = torch.Tensor | PackedWeight


@dataclass(frozen=True, slots=True)
class ModelPart:
    """The part of the model one worker holds: a TP rank of one pipeline stage. With
    expert_parallel, routed layers hold whole experts (a share of them) instead of a TP slice
    of every expert."""

    tp: TPGroup
    stage: int = 0
    num_stages: int = 1
    expert_parallel: bool = False


def build_model(
    cfg: ModelConfig,
    tensors: Iterable[tuple[str, Loaded]],
    fmt: WeightFormat,
    device: str,
    max_positions: int,
    part: ModelPart | None = None,
) -> LlamaForCausalLM:
    """Allocate without initialising (meta device), then copy every weight exactly once.
    With a part, the model is cut to it first (on the meta device) and each tensor is cut as
    it is read (models/rank_slice.py): the worker never holds the whole model."""
    with torch.device("meta"):
        model = model_class(cfg)(cfg, max_positions)
    slicer = None
    if part is not None:
        model = shard_model(model, part.tp, part.stage, part.num_stages, part.expert_parallel)
        layers = stage_layers(cfg.num_layers, part.num_stages, part.stage)
        slicer = RankSlicer(cfg, part.tp, layers, model.is_first_stage, model.is_last_stage, part.expert_parallel)
    _materialize_small(model, fmt.compute_dtype, device)
    model.cos_sin = cos_sin_cache(cfg, max_positions).to(device)
    local = local_cos_sin_cache(cfg, max_positions)
    model.cos_sin_local = None if local is None else local.to(device)
    model.weight_format = fmt
    loader = _Loader(model, cfg, fmt.compute_dtype, device, slicer)
    for name, tensor in tensors:
        loader.load(name, tensor)
    loader.finish()
    _check_complete(model, loader.filled)
    _materialize_placeholders(model, fmt.compute_dtype, device)
    return model.eval()


def _materialize_placeholders(model: LlamaForCausalLM, dtype: torch.dtype, device: str) -> None:
    """A stage's stand-ins for what it never runs (a later stage's 1x1 embedding, an earlier
    one's 1x1 LM head) get real, empty storage: nothing in the file is theirs."""
    for module in (model.embed_tokens, model.lm_head):
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(torch.zeros(p.shape, dtype=dtype, device=device), False))


def _materialize_small(model: LlamaForCausalLM, dtype: torch.dtype, device: str) -> None:
    """Every parameter but the projections' and the embedding's weights, which stay on the
    meta device until their data arrives (dense) or are replaced (packed)."""
    lazy = {id(m.weight_t) for m in model.modules() if isinstance(m, Linear)} | {id(model.embed_tokens.weight)}
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in lazy:
                setattr(module, name, nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), False))


class _Loader:
    def __init__(
        self, model: LlamaForCausalLM, cfg: ModelConfig, dtype: torch.dtype, device: str, slicer: RankSlicer | None
    ) -> None:
        self.model, self.cfg, self.dtype, self.device, self.slicer = model, cfg, dtype, device, slicer
        self.filled: set[str] = set()
        self.parts: dict[Linear, list[tuple[int, PackedWeight]]] = {}

    def load(self, name: str, tensor: Loaded) -> None:
        if name.endswith(_IGNORED) or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return
        if self.slicer is not None:  # this worker's parts only (a tied LM head included)
            for cut in self.slicer.cuts(name, tensor):
                self._put(cut.name, cut.tensor, cut.offset)
        else:
            self._put(name, tensor)
            if name == EMBED and self.cfg.tie_word_embeddings:
                self._put("lm_head.weight", tensor)  # dense: its own copy, which its method may re-lay out
        self.filled.add(name)

    def _put(self, name: str, tensor: Loaded, local_offset: int | None = None) -> None:
        module, attribute, offset = _target(self.model, self.cfg, name)
        offset = offset if local_offset is None else local_offset  # a rank's row in its fused slice
        if isinstance(tensor, PackedWeight):
            self._put_packed(module, name, tensor.to(self.device), offset)
            return
        param = getattr(module, attribute)
        if param.is_meta:
            param = nn.Parameter(torch.empty(param.shape, dtype=self.dtype, device=self.device), False)
            setattr(module, attribute, param)
        # Linear weights live transposed ([in, out]); viewing them as [out, in] keeps HF's row offsets.
        view = param.data.t() if isinstance(module, Linear) and attribute == "weight_t" else param.data
        if self.cfg.norm_offset and name.endswith("norm.weight"):  # Gemma: (1 + w) stored as one weight
            tensor = tensor.float() + self.cfg.norm_offset
        destination = view if offset is None else view[offset : offset + tensor.shape[0]]
        if destination.shape != tensor.shape:
            raise ValueError(f"weight {name}: expected shape {tuple(destination.shape)}, got {tuple(tensor.shape)}")
        destination.copy_(tensor)

    def _put_packed(self, module: nn.Module, name: str, weight: PackedWeight, offset: int | None) -> None:
        if module is self.model.embed_tokens:
            self.model.packed_embedding = weight  # the model builds its lookup in prepare_kernels
            return
        if not isinstance(module, Linear):
            raise ValueError(f"weight {name}: a packed tensor for a {type(module).__name__}")
        if weight.cols != module.in_features:
            raise ValueError(f"weight {name}: expected {module.in_features} input features, got {weight.cols}")
        self.parts.setdefault(module, []).append((offset or 0, weight))

    def finish(self) -> None:
        """Stack each projection's packed parts (in row order) and check they cover it."""
        for linear, parts in self.parts.items():
            parts.sort(key=lambda part: part[0])
            if sum(w.rows for _, w in parts) != linear.out_features:
                raise ValueError(f"packed parts cover {sum(w.rows for _, w in parts)} of {linear.out_features} rows")
            linear.set_packed(_merge([w for _, w in parts]))


def _merge(parts: list[PackedWeight]) -> list[PackedWeight]:
    """Runs of parts in one format stacked into one weight: usually a single part results."""
    merged: list[list[PackedWeight]] = []
    for part in parts:
        if merged and (merged[-1][0].kind, merged[-1][0].group) == (part.kind, part.group):
            merged[-1].append(part)
        else:
            merged.append([part])
    return [run[0] if len(run) == 1 else cat_rows(run) for run in merged]


def _target(model: LlamaForCausalLM, cfg: ModelConfig, name: str) -> tuple[nn.Module, str, int | None]:
    """The module and attribute an HF tensor goes to, and its row offset inside a fused one."""
    if name == EMBED:
        return model.embed_tokens, "weight", None
    if name == "model.norm.weight":
        return model, "norm", None
    if name == "lm_head.weight":
        return model.lm_head, "weight_t", None
    match = _LAYER.fullmatch(name)
    if not match or int(match.group(1)) >= len(model.layers):
        raise ValueError(f"unexpected weight {name!r}")
    layer, rest = model.layers[int(match.group(1))], match.group(2)
    return _layer_target(layer, cfg, rest, name)


def _layer_target(layer: nn.Module, cfg: ModelConfig, rest: str, name: str) -> tuple[nn.Module, str, int | None]:
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SparseMoE) and (target := mlp.target(rest)) is not None:
        return target
    proj, _, kind = rest.rpartition(".")
    fused = {
        "self_attn.q_proj": (attn.qkv_proj, 0),
        "self_attn.k_proj": (attn.qkv_proj, cfg.q_size),
        "self_attn.v_proj": (attn.qkv_proj, cfg.q_size + cfg.kv_size),
        "self_attn.o_proj": (attn.o_proj, None),
    }
    if not isinstance(mlp, SparseMoE):
        fused |= {
            "mlp.gate_proj": (mlp.gate_up_proj, 0),
            "mlp.up_proj": (mlp.gate_up_proj, cfg.intermediate_size),
            "mlp.down_proj": (mlp.down_proj, None),
        }
    attribute = "weight_t" if kind == "weight" else kind
    if proj in fused and getattr(fused[proj][0], attribute, None) is not None:
        module, offset = fused[proj]
        return module, attribute, offset
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight") or (
        cfg.sandwich_norms and rest in ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
    ):
        return layer, rest.split(".")[0], None
    if rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight") and cfg.qk_norm:
        return attn, rest.split(".")[1], None
    raise ValueError(f"unexpected weight {name!r}")


def _check_complete(model: LlamaForCausalLM, filled: set[str]) -> None:
    """Every expected HF tensor must have arrived; a missing one would leave garbage memory."""
    cfg = model.cfg
    expected = {EMBED, "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        expected.add("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        expected |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        if cfg.sandwich_norms:
            expected |= {p + "pre_feedforward_layernorm.weight", p + "post_feedforward_layernorm.weight"}
        expected |= {f"{p}self_attn.{x}_proj.weight" for x in "qkvo"}
        if cfg.is_moe_layer(i):
            expected |= moe_weight_names(cfg, p)
        else:
            expected |= {f"{p}mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        if cfg.qkv_bias:
            expected |= {f"{p}self_attn.{x}_proj.bias" for x in "qkv"}
        if cfg.o_bias:
            expected.add(p + "self_attn.o_proj.bias")
        if cfg.qk_norm:
            expected |= {p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"}
    missing = sorted(expected - filled)
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
