"""LinearMethod: how one projection's weight is stored and multiplied (y = x W^T + b).

A model's Linear holds its weight as loaded, dense, as `weight_t` [in, out] (the loaders
write it, tensor parallelism slices it); at load time choose_linear_method picks a method
for it, which may re-lay the weight out, pack it, quantize it or keep it as it is, and from
then on the Linear only calls the method. A method owns whatever storage it needs: where
that is not the dense weight, it takes weight_t over (e.g. re-points its data at a view of
its own copy, or frees it), so the model holds one copy of the weights.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from cadenza.kernels.cpu.packed import BoundWeight
from cadenza.kernels.quant.weight import PackedWeight


class LinearMethod(ABC):
    """One projection's weight in some storage, and the matmul that reads it."""

    @abstractmethod
    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, in] -> [M, out] = x W^T (+ bias)."""

    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes one pass over the weight reads (what a decode step streams)."""

    @property
    @abstractmethod
    def out_features(self) -> int:
        """Rows of W (output features)."""

    def row_slice(self, start: int, end: int) -> LinearMethod:
        """The same storage's output rows [start, end) as a method of its own, without a copy
        (one expert of a layer's fused expert weight: kernels/moe)."""
        raise NotImplementedError(f"{type(self).__name__} has no row slices")

    def dense_t(self) -> torch.Tensor | None:
        """W as a dense [in, out] tensor (any strides), where the storage is one; else None."""
        return None

    def c_weight(self) -> BoundWeight | None:
        """W bound for the C kernels that read weights themselves (the decode stack); None
        where this storage has no C binding."""
        return None

    def packed(self) -> PackedWeight | None:
        """W's packed storage, where the method keeps one (a tied embedding reads it)."""
        return None

    def fp32_rows(self) -> torch.Tensor | None:
        """W as contiguous fp32 [out, in] CPU rows, for kernels that read the weights
        themselves (the C decode stack); None for any other storage."""
        return None
