"""A fused projection whose parts are stored in different formats (a GGUF Q4_K_M file keeps
attn_v in Q6_K beside Q4_K q and k): each part's method runs, the outputs are concatenated."""

from __future__ import annotations

import torch

from cadenza.kernels.linear.base import LinearMethod


class StackedLinear(LinearMethod):
    def __init__(self, parts: list[LinearMethod]) -> None:
        self.parts = parts

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = torch.cat([part.apply(x, None) for part in self.parts], dim=-1)
        return y if bias is None else y.add_(bias)

    def weight_bytes(self) -> int:
        return sum(part.weight_bytes() for part in self.parts)
