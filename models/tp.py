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

from cadenza.models.config import ModelConfig


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


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """The heads one rank owns: query heads [q_start, q_end), KV heads [kv_start, kv_end)."""

    q_start: int
    q_end: int
    kv_start: int
    kv_end: int


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` when n items go to `parts` parts, sizes differing by <= 1."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


def head_slice(cfg: ModelConfig, tp: int, rank: int) -> HeadSlice:
    group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
    if cfg.num_kv_heads >= tp:
        kv_start, kv_end = split_evenly(cfg.num_kv_heads, tp, rank)
        return HeadSlice(kv_start * group, kv_end * group, kv_start, kv_end)
    if tp % cfg.num_kv_heads or group % (tp // cfg.num_kv_heads):
        raise ValueError(
            f"tensor_parallel_size={tp} cannot split {cfg.num_heads} query heads over "
            f"{cfg.num_kv_heads} KV heads: when ranks outnumber KV heads, each KV head's "
            "query group must divide evenly among the ranks that share it"
        )
    ranks_per_kv = tp // cfg.num_kv_heads
    kv = rank // ranks_per_kv
    per_rank = group // ranks_per_kv
    q_start = kv * group + (rank % ranks_per_kv) * per_rank
    return HeadSlice(q_start, q_start + per_rank, kv, kv + 1)


def padded_vocab_slice(vocab: int, tp: int, rank: int) -> tuple[int, int]:
    """Equal-width vocab slices (the last padded), so logits all-gather in one collective."""
    width = -(-vocab // tp)
    return rank * width, (rank + 1) * width


def check_tp(cfg: ModelConfig, tp: int) -> None:
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp > cfg.num_heads:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the model's {cfg.num_heads} attention heads")
    for rank in range(tp):
        head_slice(cfg, tp, rank)
