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

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    def row_slice(self, start: int, end: int) -> LinearMethod:
        """The parts' rows that fall in [start, end), each sliced by its own method."""
        pieces, offset = [], 0
        for part in self.parts:
            lo, hi = max(start, offset), min(end, offset + part.out_features)
            if lo < hi:
                pieces.append(part.row_slice(lo - offset, hi - offset))
            offset += part.out_features
        return pieces[0] if len(pieces) == 1 else StackedLinear(pieces)
