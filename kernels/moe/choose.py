"""choose_experts: how a layer's experts run, decided once when the model is prepared.

- `triton` backend over dense weights: the fused kernel (triton_fused.py) reads the layer's
  two fused weights through strides;
- anything else (the CPU, and packed formats on CUDA): the grouped path (grouped.py) over
  each expert's row slice of those weights, multiplied by the weights' own LinearMethods;
  on the CPU, where the weights are stored dense in the GEMM dtype (bf16 with bf16 GEMMs,
  fp32), batches past the few-row size take the batched path (batched.py) instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.moe.batched import BatchedExperts
from cadenza.kernels.moe.grouped import GroupedExperts
from cadenza.kernels.ops import Kernels
from cadenza.kernels.quant.weight import DENSE_KINDS

# (x [T, H], routing weights [T, k], expert ids [T, k]) -> [T, H]
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def choose_experts(
    gate_up: LinearMethod,
    down: LinearMethod,
    num_experts: int,
    first: int,
    local: int,
    kernels: Kernels,
    gemm_dtype: torch.dtype = torch.float32,
) -> Experts:
    """Experts [first, first + local) of num_experts, whose gate|up rows (2I each) and down
    rows (H each) are stacked expert by expert in the two fused weights' methods;
    gemm_dtype: the weight format's many-row GEMM dtype."""
    w13, w2 = gate_up.dense_t(), down.dense_t()
    if kernels.backend == "triton" and w13 is not None and w2 is not None and local == num_experts:
        return _fused(w13.t().view(local, -1, w13.shape[0]), w2.t().view(local, -1, w2.shape[0]))
    gate_up_rows, down_rows = gate_up.out_features // local, down.out_features // local
    grouped = GroupedExperts(
        [gate_up.row_slice(e * gate_up_rows, (e + 1) * gate_up_rows) for e in range(local)],
        [down.row_slice(e * down_rows, (e + 1) * down_rows) for e in range(local)],
        num_experts,
        first,
        kernels.silu_and_mul,
    )
    rows13, rows2 = _stored_rows(gate_up), _stored_rows(down)
    if kernels.backend == "triton" or rows13 is None or rows2 is None or rows13.device.type != "cpu":
        return grouped
    dtype = rows13.dtype if rows13.dtype == torch.float32 else gemm_dtype
    if rows13.dtype != dtype or rows2.dtype != dtype:
        return grouped
    w13_rows, w2_rows = rows13.view(local, gate_up_rows, -1), rows2.view(local, down_rows, -1)
    return BatchedExperts(w13_rows, w2_rows, dtype, kernels.silu_and_mul, grouped)


def _stored_rows(method: LinearMethod) -> torch.Tensor | None:
    """W's [out, in] rows where the method stores them dense (fp32, or a bf16 / f16 kind)."""
    rows = method.fp32_rows()
    if rows is not None:
        return rows
    packed = method.packed()
    return packed.data if packed is not None and packed.kind in DENSE_KINDS else None


def _fused(w13: torch.Tensor, w2: torch.Tensor) -> Experts:
    from cadenza.kernels.moe.triton_fused import fused_moe_triton  # Triton only where it runs

    def run(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_moe_triton(x, w13, w2, weights, ids)

    return run
