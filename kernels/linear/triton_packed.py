"""The packed Triton method: a q8 / q4 PackedWeight on a CUDA device, multiplied by the Triton
GEMMs of quant/triton_gemm.py as stored (codes and scales, 1 or 1/2 byte a weight), so a
decode step streams the packed bytes rather than a dequantized copy."""

from __future__ import annotations

import torch

from cadenza.kernels.backend import backend
from cadenza.kernels.linear.base import LinearMethod
from cadenza.kernels.quant.triton_gemm import packed_matmul_ref, packed_matmul_triton
from cadenza.kernels.quant.weight import TRITON_KINDS, PackedWeight


class TritonPackedLinear(LinearMethod):
    def __init__(self, weight: PackedWeight) -> None:
        if weight.kind not in TRITON_KINDS:
            raise ValueError(f"TritonPackedLinear reads {', '.join(TRITON_KINDS)} weights, not {weight.kind!r}")
        self.weight = weight

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # The backend is read per call: CADENZA_KERNELS=torch swaps in the dequantizing reference.
        if backend(x.device) == "torch":
            return packed_matmul_ref(x, self.weight, bias)
        return packed_matmul_triton(x, self.weight, bias)

    def weight_bytes(self) -> int:
        return self.weight.nbytes

    def packed(self) -> PackedWeight:
        return self.weight
