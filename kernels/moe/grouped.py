"""The grouped expert path: tokens gathered per expert, each expert's rows as one GEMM.

Each expert's gate|up and down projections are row slices of the layer's two fused weights,
multiplied by those weights' own LinearMethods (so every weight format works: dense, bf16,
int8, int4, a GGUF's packed quants); an expert no token chose is never read, so a decode step
streams only its k experts' weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.moe.routing import sort_by_expert


class GroupedExperts:
    """The experts [first, first + len(gate_up)) of a layer of num_experts (expert parallelism
    holds a run of them; the rest are another rank's and add nothing here)."""

    def __init__(
        self,
        gate_up: list[LinearMethod],
        down: list[LinearMethod],
        num_experts: int,
        first: int,
        silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.gate_up, self.down, self.num_experts, self.first = gate_up, down, num_experts, first
        self.silu_and_mul = silu_and_mul

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], routing weights / ids [T, k] -> sum over each token's experts [T, H]."""
        top_k = ids.shape[1]
        pairs, counts = sort_by_expert(ids, self.num_experts)
        flat_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts.tolist()):  # one host sync for the whole layer
            chosen, start = pairs[start : start + count], start + count
            local = expert - self.first
            if count == 0 or not 0 <= local < len(self.gate_up):
                continue
            tokens = chosen // top_k
            h = self.silu_and_mul(self.gate_up[local].apply(x[tokens], None))
            y = self.down[local].apply(h, None) * flat_weights[chosen, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out
