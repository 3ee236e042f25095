"""Routed experts (Mixtral, Qwen3-MoE) in place of a layer's MLP.

A layer's experts are two fused weights, stacked expert by expert: gate_up_proj [E x 2I rows,
H] (each expert's gate rows, then its up rows) and down_proj [E x H rows, I]. They are plain
Linears, so every weight format packs them as it packs any projection (row by row, so each
expert is quantized on its own), and a GGUF's [E, I, H] expert tensors are already this
layout. How the experts run is chosen once at load (kernels/moe/choose.py): the fused Triton
kernel over the dense weights, or the grouped path over each expert's row slice. The router
stays dense in the compute dtype: it decides which weights are read at all.

Under tensor parallelism each expert's I is split like a dense MLP's; under expert
parallelism each rank holds whole experts [first_expert, first_expert + local_experts) and
computes only their share. Either way the ranks' partial outputs are summed by one
all-reduce, as a row-parallel MLP's are; the scheduler and KV cache never see experts.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from cadenza.kernels.moe.choose import Experts, choose_experts
from cadenza.kernels.moe.routing import route_top_k
from cadenza.kernels.ops import Kernels
from cadenza.models.config import ModelConfig
from cadenza.models.linear import Linear
from cadenza.models.tp import SINGLE, TPGroup

# Checkpoint names of a layer's MoE tensors -> (expert or None for the router, role).
_EXPERT = re.compile(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight")
_ROUTER = re.compile(r"(?:block_sparse_moe|mlp)\.gate\.weight")
_ROLES = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        experts, inter, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.top_k, self.renormalize = experts, cfg.experts_per_token, cfg.renormalize_experts
        self.hidden_size = hidden
        # This rank's share (models/shard.py and rank_slice.py cut it): whole experts under
        # expert parallelism, a slice of every expert's intermediate size under TP.
        self.first_expert, self.local_experts, self.intermediate = 0, experts, inter
        self.router = nn.Parameter(torch.empty(experts, hidden))
        self.gate_up_proj = Linear(hidden, experts * 2 * inter, bias=False)
        self.down_proj = Linear(inter, experts * hidden, bias=False)
        self.reduce: TPGroup = SINGLE
        self.experts: Experts | None = None  # chosen by prepare (the model's prepare_kernels)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        weights, ids = route_top_k(nn.functional.linear(x, self.router), self.top_k, self.renormalize)
        experts = self.experts if self.experts is not None else self.prepare(kernels)
        return self.reduce.all_reduce(experts(x, weights, ids))

    def prepare(self, kernels: Kernels, gemm_dtype: torch.dtype = torch.float32) -> Experts:
        """Bind the experts' path to the projections' methods (an unprepared model binds the
        dense weights as loaded, on its first step); gemm_dtype: the format's many-row GEMMs'."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if gate_up.method is None or down.method is None:
            from cadenza.kernels.linear.dense import DenseLinear

            gate_up.method, down.method = DenseLinear(gate_up.weight_t), DenseLinear(down.weight_t)
        self.experts = choose_experts(
            gate_up.method, down.method, self.num_experts, self.first_expert, self.local_experts, kernels, gemm_dtype
        )
        return self.experts

    def target(self, rest: str) -> tuple[nn.Module, str, int | None] | None:
        """Where a checkpoint tensor of this layer goes (module, attribute, row offset), or None
        when `rest` is not an MoE tensor of this rank (another rank's expert included)."""
        if _ROUTER.fullmatch(rest):
            return self, "router", None
        match = _EXPERT.fullmatch(rest)
        if match is None:
            return None
        local = int(match.group(1)) - self.first_expert
        if not 0 <= local < self.local_experts:
            return None
        role = _ROLES[match.group(2)]
        if role == "down":
            return self.down_proj, "weight_t", local * self.hidden_size
        return self.gate_up_proj, "weight_t", (2 * local + (role == "up")) * self.intermediate


def expert_of(rest: str) -> tuple[int, str] | None:
    """(expert, role) of a layer's expert tensor name, ("router" for the gate: expert -1)."""
    if _ROUTER.fullmatch(rest):
        return -1, "router"
    match = _EXPERT.fullmatch(rest)
    return None if match is None else (int(match.group(1)), _ROLES[match.group(2)])


def expert_weight_name(cfg: ModelConfig, prefix: str, expert: int, role: str) -> str:
    """A routed layer's tensor name in this architecture's spelling (Mixtral's w1 / w3 / w2
    or Qwen3-MoE's gate_proj / up_proj / down_proj); role "router" is the gate."""
    mixtral = cfg.architecture == "MixtralForCausalLM"
    block = "block_sparse_moe" if mixtral else "mlp"
    if role == "router":
        return f"{prefix}{block}.gate.weight"
    leaf = {"gate": "w1", "up": "w3", "down": "w2"}[role] if mixtral else f"{role}_proj"
    return f"{prefix}{block}.experts.{expert}.{leaf}.weight"


def moe_weight_names(cfg: ModelConfig, prefix: str) -> set[str]:
    """The checkpoint names one routed layer's tensors have."""
    names = {expert_weight_name(cfg, prefix, -1, "router")}
    roles = ("gate", "up", "down")
    return names | {expert_weight_name(cfg, prefix, e, r) for e in range(cfg.num_experts) for r in roles}
