"""The dense method: W as loaded, [in, out], through torch's matmul (any dtype, any device).

[in, out] because MKL's fp32 GEMV streams it at ~25 GB/s against ~13 for [out, in] (see
cpu_fp32.py, which re-lays W out only where it has faster paths for it).
"""

from __future__ import annotations

import torch

from cadenza.kernels.linear.base import LinearMethod


def dense_linear(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W_t (+ bias): addmm fuses the bias into the GEMM."""
    return x @ weight_t if bias is None else torch.addmm(bias, x, weight_t)


class DenseLinear(LinearMethod):
    def __init__(self, weight_t: torch.Tensor) -> None:
        self.weight_t = weight_t

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, self.weight_t, bias)

    def weight_bytes(self) -> int:
        return self.weight_t.nbytes

    @property
    def out_features(self) -> int:
        return self.weight_t.shape[1]

    def row_slice(self, start: int, end: int) -> LinearMethod:
        return DenseLinear(self.weight_t[:, start:end])

    def dense_t(self) -> torch.Tensor:
        return self.weight_t
