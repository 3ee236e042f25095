"""The CPU fp32 method: W re-laid out as [out, in], the C GEMV for few rows, oneDNN for small batches.

Measured here (MKL, 2 cores): x @ W_t streams a decode step's weights at ~25 GB/s, while
F.linear on the [out, in] layout manages ~13 GB/s; at large M both are compute-bound alike.
Between the two, MKL's GEMM is poor: 5 rows cost ~4x one row (it repacks W every call).
So W is re-laid out as [out, in] (MKL is as fast either way at large M) for two faster paths:
- up to FEW_ROWS rows (single-stream decode, k + 1 verification): the C GEMV of cpu/gemv.py
  reads W once for all rows, at ~28 GB/s where x @ W_t manages 13-22 (two cores);
- up to SMALL_BATCH_ROWS rows: a oneDNN-packed copy (doubling the weights' memory): 5 rows
  of the 576x3072 MLP weight take 0.37 ms vs 0.79 ms, the LM head 12.8 vs 36.7 ms (one core).
The figures are `/tmp` microbenchmarks quoted in the issue notes.
"""

from __future__ import annotations

import torch
from torch import nn

from cadenza.kernels.backend import backend
from cadenza.kernels.cpu.gemv import linear_few_rows
from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.linear.dense import dense_linear
from cadenza.kernels.linear.onednn import pack, packed_linear

# Rows up to which the C GEMV runs, which reads W once for all rows: single-stream decode,
# k + 1 speculative verification, small decode batches.
FEW_ROWS = 8
# Rows up to which the oneDNN-packed copy runs: larger decode batches.
SMALL_BATCH_ROWS = 64


class CpuFp32Linear(LinearMethod):
    def __init__(self, weight_t: nn.Parameter, few_rows_kernel: bool, packed: bool) -> None:
        rows = weight_t.detach().t().contiguous()
        # The parameter stays (weights and state_dict see it) as a view of the rows: one copy of W.
        weight_t.data = rows.t()
        self.rows, self.weight_t = rows, rows.t()
        self.few_rows_kernel = few_rows_kernel
        self.packed = pack(rows) if packed else None

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        rows = x.shape[0]
        # The backend is read per call: CADENZA_KERNELS=torch turns the C GEMV off.
        if self.few_rows_kernel and rows <= FEW_ROWS and backend() == "cpu":
            return linear_few_rows(x, self.rows, bias)
        if self.packed is not None and 1 < rows <= SMALL_BATCH_ROWS:
            return packed_linear(x, self.packed, bias)
        return dense_linear(x, self.weight_t, bias)

    def weight_bytes(self) -> int:
        return self.rows.nbytes  # a call reads the rows or the oneDNN copy, never both

    def fp32_rows(self) -> torch.Tensor:
        return self.rows
