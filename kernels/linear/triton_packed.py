"""The packed Triton method: a q8 / q4 PackedWeight on a CUDA device, multiplied by the Triton
GEMMs of quant/triton_gemm.py as stored (codes and scales, 1 or 1/2 byte a weight), so a
decode step streams the packed bytes rather than a dequantized copy."""

from __future__ import annotations

import torch

from cadenza.kernels.backend import backend
from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.quant.dequantize import packed_matmul_ref
from cadenza.kernels.quant.triton_gemm import packed_matmul_triton
from cadenza.kernels.quant.weight import TRITON_KINDS, PackedWeight


class TritonPackedLinear(LinearMethod):
    def __init__(self, weight: PackedWeight) -> None:
        if weight.kind not in TRITON_KINDS:
            raise ValueError(f"TritonPackedLinear reads {', '.join(TRITON_KINDS)} weights, not {weight.kind!r}")
        self.weight = weight
        # The backend is read once, here (load time): CADENZA_KERNELS=torch binds the
        # dequantizing reference instead of the Triton GEMM.
        torch_backend = backend(weight.device) == "torch"
        self._matmul = packed_matmul_ref if torch_backend else packed_matmul_triton

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self._matmul(x, self.weight, bias)

    def weight_bytes(self) -> int:
        return self.weight.nbytes

    @property
    def out_features(self) -> int:
        return self.weight.rows

    def row_slice(self, start: int, end: int) -> LinearMethod:
        return TritonPackedLinear(self.weight.row_view(start, end))

    def packed(self) -> PackedWeight:
        return self.weight
