"""oneDNN's packed-weight linear, through torch's private mkldnn ops (the only place they are
called): torch exposes no public way to keep a weight in oneDNN's blocked layout."""

from __future__ import annotations

import torch


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


def pack(rows: torch.Tensor) -> torch.Tensor:
    """A oneDNN-blocked copy of fp32 W [out, in] (8: the batch size oneDNN lays it out for)."""
    return torch.ops.mkldnn._reorder_linear_weight(rows, 8)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) with W as pack() laid it out; no post-op ("none")."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
