"""Linear: one projection of a decoder, its weight as loaded until a LinearMethod takes it over."""

from __future__ import annotations

import torch
from torch import nn

from cadenza.kernels.linear import LinearMethod, dense_linear
from cadenza.kernels.quant.weight import PackedWeight
from cadenza.models.tp import SINGLE, TPGroup


class Linear(nn.Module):
    """y = x W^T + b. W arrives dense as weight_t [in, out] (the loaders fill it, tensor
    parallelism slices it); prepare_kernels then hands it to the LinearMethod chosen for it."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        # Set instead of weight_t when the weight arrives packed (a GGUF's blocks kept as
        # stored), or when prepare_kernels packs it: one part, or several by rows.
        self.packed: list[PackedWeight] | None = None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # Row-parallel under tensor parallelism: partial sums are all-reduced across ranks.
        self.reduce: TPGroup = SINGLE
        self.method: LinearMethod | None = None  # None until chosen: the dense weight_t as loaded

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = dense_linear(x, self.weight_t, self.bias) if self.method is None else self.method.apply(x, self.bias)
        return self.reduce.all_reduce(y)

    def weight_bytes(self) -> int:
        return self.weight_t.nbytes if self.method is None else self.method.weight_bytes()

    def set_packed(self, parts: list[PackedWeight]) -> None:
        """Hold W as packed parts from now on; the dense weight_t is released (one copy)."""
        self.packed = parts
        self.weight_t = nn.Parameter(torch.empty(0, device=parts[0].device), requires_grad=False)
