"""choose_linear_method: the one place that decides how each projection's weight is stored."""

from __future__ import annotations

import torch
from torch import nn

from cadenza.kernels.cpu.gemv import gemv_available
from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.linear.cpu_fp32 import CpuFp32Linear
from cadenza.kernels.linear.dense import DenseLinear
from cadenza.kernels.linear.onednn import onednn_available


def choose_linear_method(weight_t: nn.Parameter) -> LinearMethod:
    """The method for one projection's loaded dense weight [in, out], picked once at load time
    (after sharding, so it sees this rank's slice); it may take weight_t over.

    CPU fp32: the [out, in] re-layout with the C GEMV where this host builds it and oneDNN
    where torch has it. Anything else, and one-element placeholders (a pipeline stage's
    unused lm_head), stays dense through torch."""
    on_cpu_fp32 = weight_t.device.type == "cpu" and weight_t.dtype == torch.float32
    if not on_cpu_fp32 or weight_t.numel() <= 1:
        return DenseLinear(weight_t)
    return CpuFp32Linear(weight_t, few_rows_kernel=gemv_available(), packed=onednn_available())
