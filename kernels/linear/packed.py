"""The packed method: W kept in its stored format (kernels/quant/weight.py) on the CPU.

- up to PACKED_FEW_ROWS rows (decode, k + 1 verification, small decode batches), or as many
  as the C kernel's fused path takes (BoundWeight.fused_rows: with int8_activations on
  AVX-512, q4 and, on VNNI, q8 take any batch, prefill included: csrc/tiled_batch512.c): the
  C kernel reads the stored bytes once for all rows (csrc/packed_linear.c);
- more rows (larger batches, prefill): tiles of W decoded to fp32 by the C kernel, each
  multiplied by the BLAS at its rate (at 32 rows, decoding a tile then MKL beat the C
  kernel's row loop by ~1.3x on a 3072 x 576 projection); a tile is at most TILE_ELEMENTS
  weights, so the fp32 copy is a bounded scratch, never the whole matrix. Below 64 rows the
  BLAS may run W @ x.T far faster than x @ W.T: the form is raced once per row bucket
  (kernels/linear/orientation.py).
Without the C build (or under CADENZA_KERNELS=torch) the torch reference decodes the tiles.
gemm_dtype bf16 (WeightFormat.gemm_dtype: where the CPU multiplies bf16 natively) runs those
many-row GEMMs on x and the tiles rounded to bf16, fp32 back: oneDNN's bf16 GEMM ran at
~2.8x its fp32 rate on an AVX512-BF16 Zen, and a 512-token prefill took 0.68-0.73 s
against 1.21-1.28 s (docs/bench/cpu_gemm.json; 0.49-0.51 s with the rest of the prefill
cut too, cpu_prefill_bf16.json). The C kernel decodes those tiles straight to bf16; a bf16
weight's tiles are its own storage.
With int8_activations the q4 / q8 formats read x rounded to int8 per block of 32 in every
path (see csrc/packed_linear.c); without it (the default) every path is exact fp32.
"""

from __future__ import annotations

import torch

from cadenza.kernels.backend import backend
from cadenza.kernels.cpu.packed import (
    BoundWeight,
    packed_available,
    packed_dequantize,
    packed_gather,
    packed_linear,
    round_activations,
)
from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.linear.orientation import transposed_wins
from cadenza.kernels.quant.dequantize import dequantize, round_activations_ref
from cadenza.kernels.quant.weight import DENSE_KINDS, PackedWeight

PACKED_FEW_ROWS = 16
TILE_ELEMENTS = 1 << 20  # 4 MB of fp32: one decoded tile, in L2/L3 while the GEMM reads it


class PackedLinear(LinearMethod):
    """int8_activations: q4 / q8 read x rounded to int8 per block of 32 in every path."""

    def __init__(
        self, weight: PackedWeight, int8_activations: bool = False, gemm_dtype: torch.dtype = torch.float32
    ) -> None:
        self.weight = weight
        self.gemm_dtype = gemm_dtype
        self.round_x = int8_activations and weight.can_round_activations
        # The backend is read once, here (load time): under CADENZA_KERNELS=torch, or without
        # the C build, nothing is bound and every call runs the torch reference.
        native = weight.device.type == "cpu" and backend(weight.device) == "cpu"
        self.bound = BoundWeight(weight, self.round_x) if native and packed_available() else None
        # Rows that go to the C kernel: the few-row bound, or more where its fused path takes a
        # whole batch (q4 / q8 with int8_activations on AVX-512: csrc/packed_linear.c's INTEGER_ROWS).
        self.c_rows = max(PACKED_FEW_ROWS, self.bound.fused_rows) if self.bound is not None else 0

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        bound = self.bound
        if bound is not None and x.shape[0] <= self.c_rows:
            return packed_linear(bound, x.float(), bias)
        return self._tiled(x if x.is_cuda else x.float(), bias, bound)

    def _tiled(self, x: torch.Tensor, bias: torch.Tensor | None, bound: BoundWeight | None) -> torch.Tensor:
        w = self.weight
        if self.round_x and not x.is_cuda:  # as the few-row kernel reads x, whatever the batch
            x = round_activations(x) if bound is not None else round_activations_ref(x)
        dtype = self._gemm_dtype(x)
        xg = x.to(dtype)
        step = max(TILE_ELEMENTS // w.cols, 1)
        tiles = (self._tile(bound, start, min(start + step, w.rows), dtype) for start in range(0, w.rows, step))
        if not x.is_cuda and transposed_wins(x.shape[0], dtype):  # the BLAS's faster form here
            y = _joined([tile @ xg.T for tile in tiles], 0).T.contiguous()
        else:
            y = _joined([xg @ tile.T for tile in tiles], 1)
        y = y.to(x.dtype)
        return y if bias is None else y.add_(bias)

    def _gemm_dtype(self, x: torch.Tensor) -> torch.dtype:
        """x's own on CUDA; on the CPU gemm_dtype past the few-row kernel, fp32 at or under it
        (the torch reference too, so both backends round the same rows)."""
        if x.is_cuda:
            return x.dtype
        return self.gemm_dtype if x.shape[0] > PACKED_FEW_ROWS else torch.float32

    def _tile(self, bound: BoundWeight | None, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) of W in dtype: stored dense in it already, else decoded."""
        w = self.weight
        if DENSE_KINDS.get(w.kind) == dtype:
            return w.data[start:end]
        if bound is not None:  # decoded straight to dtype (fp32 or bf16), written once
            return packed_dequantize(bound, start, end, dtype)
        return dequantize(w, start, end).to(dtype)

    def gather_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W as fp32 (embedding lookups from the same storage)."""
        if self.bound is not None:
            return packed_gather(self.bound, ids)
        return dequantize(self.weight.take_rows(ids))

    def weight_bytes(self) -> int:
        return self.weight.nbytes

    @property
    def out_features(self) -> int:
        return self.weight.rows

    def row_slice(self, start: int, end: int) -> LinearMethod:
        return PackedLinear(self.weight.row_view(start, end), self.round_x, self.gemm_dtype)

    def packed(self) -> PackedWeight:
        return self.weight

    def c_weight(self) -> BoundWeight | None:
        return self.bound


def _joined(parts: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The tiles' products side by side; one tile's as it is (a prefill's output, not copied)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
