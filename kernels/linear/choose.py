"""choose_linear_method: the one place that decides how each projection's weight is stored."""

from __future__ import annotations

import torch
from torch import nn

from cadenza.kernels.backend import backend
from cadenza.kernels.cpu.gemv import gemv_available
from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.linear.cpu_fp32 import CpuFp32Linear
from cadenza.kernels.linear.dense import DenseLinear
from cadenza.kernels.linear.packed import PackedLinear
from cadenza.kernels.linear.stacked import StackedLinear
from cadenza.kernels.quant.weight import TRITON_KINDS, PackedWeight


def choose_linear_method(
    weight: nn.Parameter | list[PackedWeight],
    int8_activations: bool = False,
    gemm_dtype: torch.dtype = torch.float32,
) -> LinearMethod:
    """The method for one projection, picked once at load time (after sharding, so it sees
    this rank's slice); it may take a dense weight_t over.

    Dense [in, out] weights: on the CPU in fp32, the [out, in] re-layout with the C GEMV
    where this host builds it and the backend is `cpu`; anything else, and one-element
    placeholders (a pipeline stage's unused lm_head), stays dense through torch.
    Packed weights (one part, or several stacked by rows when a fused projection's parts are
    stored in different formats): the C packed kernels on the CPU, Triton on CUDA;
    int8_activations: the CPU's q4 / q8 kernels read x rounded to int8; gemm_dtype: the CPU's
    many-row GEMMs over packed weights (see packed.py). Dense fp32 weights stay fp32."""
    if isinstance(weight, list):
        methods = [_packed_method(part, int8_activations, gemm_dtype) for part in weight]
        return methods[0] if len(methods) == 1 else StackedLinear(methods)
    on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
    if not on_cpu_fp32 or weight.numel() <= 1:
        return DenseLinear(weight)
    # The backend is read once per projection, here: CADENZA_KERNELS=torch (or triton) keeps
    # the C GEMV off, and builds nothing.
    return CpuFp32Linear.taking_over(weight, few_rows_kernel=backend(weight.device) == "cpu" and gemv_available())


def _packed_method(weight: PackedWeight, int8_activations: bool, gemm_dtype: torch.dtype) -> LinearMethod:
    if weight.device.type == "cuda" and weight.kind in TRITON_KINDS:
        from cadenza.kernels.linear.triton_packed import TritonPackedLinear  # Triton only where CUDA is

        return TritonPackedLinear(weight)
    return PackedLinear(weight, int8_activations, gemm_dtype)
