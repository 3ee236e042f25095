"""The batched expert path: every expert's rows padded to one height and multiplied as one
batched GEMM per projection (torch.bmm in the GEMM dtype), for batches past the few-row size.

Per-expert calls at batch 32 (about 8 rows an expert for top-2 of 8) ran the products in
fp32 through the few-row kernels, one call pair per expert: 3.0 ms a layer on a Sapphire
Rapids Xeon against 1.0 ms for two bf16 bmm over the padded experts, which stream the
weights at the bandwidth bound (docs/bench/moe.json). It reads the weights' dense rows in
place (bf16 / f16 / fp32 storage; a quantized format keeps the grouped path), and like a
dense projection's many-row GEMMs (kernels/linear/packed.py) it multiplies in gemm_dtype
only past PACKED_FEW_ROWS tokens; smaller steps take the grouped path, exact in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from cadenza.kernels.linear.packed import PACKED_FEW_ROWS
from cadenza.kernels.moe.grouped import GroupedExperts
from cadenza.kernels.moe.routing import sort_by_expert

# Padding past this many times the rows routed would waste more than the batching saves
# (a batch whose tokens crowd into few experts): such a step takes the grouped path.
MAX_PADDING = 2


class BatchedExperts:
    def __init__(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        gemm_dtype: torch.dtype,
        silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
        grouped: GroupedExperts,
    ) -> None:
        """w13 [local, 2I, H] and w2 [local, H, I]: the experts' rows as stored."""
        self.w13, self.w2, self.gemm_dtype, self.silu_and_mul = w13, w2, gemm_dtype, silu_and_mul
        self.grouped = grouped

    def __call__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        tokens, top_k = ids.shape
        if tokens <= PACKED_FEW_ROWS:
            return self.grouped(x, weights, ids)
        grouped = self.grouped
        local = self.w13.shape[0]
        pairs, counts = sort_by_expert(ids, grouped.num_experts)
        mine = counts[grouped.first : grouped.first + local]
        height = int(mine.max())
        if height * local > MAX_PADDING * int(mine.sum()):
            return grouped(x, weights, ids)
        # Each pair's (expert, row) in the padded batch; pairs of other ranks' experts dropped.
        expert = ids.flatten()[pairs] - grouped.first
        starts = torch.cumsum(counts, 0) - counts
        row = torch.arange(pairs.numel()) - starts[expert + grouped.first]
        keep = (expert >= 0) & (expert < local)
        pairs, expert, row = pairs[keep], expert[keep], row[keep]
        batch = x.new_zeros(local, height, x.shape[1], dtype=self.gemm_dtype)
        batch[expert, row] = x[pairs // top_k].to(self.gemm_dtype)
        h = self.silu_and_mul(torch.bmm(batch, self.w13.transpose(1, 2).to(self.gemm_dtype)))
        y = torch.bmm(h, self.w2.transpose(1, 2).to(self.gemm_dtype))[expert, row]
        out = torch.zeros_like(x)
        out.index_add_(0, pairs // top_k, (y.float() * weights.flatten()[pairs, None]).to(out.dtype))
        return out
