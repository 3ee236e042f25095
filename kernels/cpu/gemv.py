"""The few-rows GEMV in C (csrc/gemv.c): y = x W^T + b reading W once for all of x's rows."""

from __future__ import annotations

import torch

from cadenza.kernels.cpu.bindings import GEMV_ROWS


def gemv_available() -> bool:
    return GEMV_ROWS.available()


def linear_few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias for contiguous fp32 CPU tensors (the caller checks);
    W is read once whatever M is, so it pays for M up to a handful (see linear/cpu_fp32.py)."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    GEMV_ROWS(
        x=x, w=weight, bias=bias, y=y, m_dim=x.shape[0], k_dim=weight.shape[1], n_dim=weight.shape[0],
        num_threads=torch.get_num_threads(),
    )  # fmt: skip
    return y
