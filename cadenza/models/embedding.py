"""Token embeddings read from packed storage (a GGUF's Q8_0 table, or the int8 / bf16 copy
a tied LM head keeps): rows are decoded as they are looked up, never expanded as a table."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cadenza.kernels.quant.weight import PackedWeight


class PackedEmbedding(nn.Module):
    """nn.Embedding's forward over a PackedWeight [vocab, hidden]; fp32 rows out."""

    def __init__(self, weight: PackedWeight, lookup: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.packed = weight
        self.num_embeddings, self.embedding_dim = weight.rows, weight.cols
        self._lookup = lookup

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = self._lookup(ids.reshape(-1))
        return flat.view(*ids.shape, self.embedding_dim)

    def weight_bytes(self) -> int:
        return self.packed.nbytes
