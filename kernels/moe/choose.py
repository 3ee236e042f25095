"""choose_experts: how a layer's experts run, decided once when the model is prepared.

- `triton` backend over dense weights: the fused kernel (triton_fused.py) reads the layer's
  two fused weights through strides;
- anything else (the CPU, and packed formats on CUDA): the grouped path (grouped.py) over
  each expert's row slice of those weights, multiplied by the weights' own LinearMethods.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.moe.grouped import GroupedExperts
from cadenza.kernels.ops import Kernels

# (x [T, H], routing weights [T, k], expert ids [T, k]) -> [T, H]
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def choose_experts(
    gate_up: LinearMethod, down: LinearMethod, num_experts: int, first: int, local: int, kernels: Kernels
) -> Experts:
    """Experts [first, first + local) of num_experts, whose gate|up rows (2I each) and down
    rows (H each) are stacked expert by expert in the two fused weights' methods."""
    w13, w2 = gate_up.dense_t(), down.dense_t()
    if kernels.backend == "triton" and w13 is not None and w2 is not None and local == num_experts:
        return _fused(w13.t().view(local, -1, w13.shape[0]), w2.t().view(local, -1, w2.shape[0]))
    gate_up_rows, down_rows = gate_up.out_features // local, down.out_features // local
    return GroupedExperts(
        [gate_up.row_slice(e * gate_up_rows, (e + 1) * gate_up_rows) for e in range(local)],
        [down.row_slice(e * down_rows, (e + 1) * down_rows) for e in range(local)],
        num_experts,
        first,
        kernels.silu_and_mul,
    )


def _fused(w13: torch.Tensor, w2: torch.Tensor) -> Experts:
    from cadenza.kernels.moe.triton_fused import fused_moe_triton  # Triton only where it runs

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_moe_triton(x, w13, w2, weights, ids)

    return run
