"""Tensor parallelism: how one rank's slice of a Llama model is cut, and the collectives it needs.

Megatron-style: q/k/v and gate/up are column-parallel (each rank owns whole heads and a
slice of the MLP), o_proj and down_proj are row-parallel (partial sums, all-reduced), the
embedding and LM head are vocab-parallel. Heads are cut at KV-group boundaries, so GQA
groups never straddle ranks; splits may be uneven (SmolLM2's 3 KV heads over 2 ranks).
When ranks outnumber KV heads, each KV head is replicated on the ranks sharing its group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from cadenza.models.partition import (  # noqa: F401 - this module's API
    HeadSlice,
    check_tp,
    head_slice,
    padded_vocab_slice,
    split_evenly,
)


@dataclass(frozen=True, slots=True)
class TPGroup:
    rank: int
    size: int
    group: dist.ProcessGroup | None  # None for size 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (equal shapes: callers pad)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup(0, 1, None)
