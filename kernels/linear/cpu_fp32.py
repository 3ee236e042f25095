"""The CPU fp32 method: W re-laid out as [out, in], the C GEMV for few rows, the BLAS beyond.

Measured here (MKL, 2 cores): x @ W_t streams a decode step's weights at ~25 GB/s, while
F.linear on the [out, in] layout manages ~13 GB/s; at large M both are compute-bound alike.
So W is re-laid out as [out, in] for the faster few-row path: up to FEW_ROWS rows
(single-stream decode, k + 1 verification) the C GEMV of cpu/gemv.py reads W once for all
rows, at ~28 GB/s where x @ W_t manages 13-22 (two cores). The same rows serve a tied
embedding's lookups, so fp32 holds one copy of each weight.

A oneDNN-packed second copy used to serve 9-64 rows (at 32 rows the LM head took 18.5 ms
against 41 through MKL, a 3072 x 576 projection 0.86 against 1.42 ms); it doubled the
weights' memory, and a format's resident bytes are now held to its size, so it is gone. Most
of that difference was MKL's kernel for x @ W_t below 64 rows: (W @ x.T).T, on the rows this
method holds anyway, ran 2-3x faster on an Ice Lake Xeon, and is taken where a race at first
use says it wins (kernels/linear/orientation.py).
"""

from __future__ import annotations

import torch
from torch import nn

from cadenza.kernels.cpu.gemv import linear_few_rows
from cadenza.kernels.cpu.packed import BoundWeight
from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.linear.dense import dense_linear
from cadenza.kernels.linear.orientation import transposed_wins
from cadenza.kernels.quant.weight import PackedWeight

# Rows up to which the C GEMV runs, which reads W once for all rows: single-stream decode,
# k + 1 speculative verification, small decode batches.
FEW_ROWS = 8


class CpuFp32Linear(LinearMethod):
    def __init__(self, rows: torch.Tensor, few_rows_kernel: bool) -> None:
        """rows: W as contiguous [out, in] fp32. few_rows_kernel: run the C GEMV up to FEW_ROWS
        rows (choose_linear_method decides it once, from the backend and the build); without
        it every row count goes to the BLAS."""
        self.rows, self.weight_t = rows, rows.t()
        self.few_rows_kernel = few_rows_kernel
        self._bound: BoundWeight | None = None

    @classmethod
    def taking_over(cls, weight_t: nn.Parameter, few_rows_kernel: bool) -> CpuFp32Linear:
        """The method over a loaded [in, out] parameter, re-laid out as rows; the parameter
        stays (weights and state_dict see it) as a view of the rows: one copy of W."""
        rows = weight_t.detach().t().contiguous()
        weight_t.data = rows.t()
        return cls(rows, few_rows_kernel)

    @property
    def out_features(self) -> int:
        return self.rows.shape[0]

    def row_slice(self, start: int, end: int) -> LinearMethod:
        return CpuFp32Linear(self.rows[start:end], self.few_rows_kernel)  # a contiguous view

    def dense_t(self) -> torch.Tensor:
        return self.weight_t

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.few_rows_kernel and x.shape[0] <= FEW_ROWS:
            return linear_few_rows(x, self.rows, bias)
        if transposed_wins(x.shape[0], torch.float32):  # this BLAS's faster form at these rows
            y = (self.rows @ x.T).T.contiguous()
            return y if bias is None else y.add_(bias)
        return dense_linear(x, self.weight_t, bias)

    def weight_bytes(self) -> int:
        return self.rows.nbytes

    def fp32_rows(self) -> torch.Tensor:
        return self.rows

    def c_weight(self) -> BoundWeight | None:
        if self._bound is None and self.few_rows_kernel:
            self._bound = BoundWeight(PackedWeight("f32", self.rows.shape[0], self.rows.shape[1], self.rows))
        return self._bound
