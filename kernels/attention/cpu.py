"""Paged decode attention in C (csrc/decode_attention.c) for the `cpu` backend: one-query rows
reading K/V in place through the block tables, rather than gathering a padded copy."""

from __future__ import annotations

import torch

from cadenza.kernels.cpu.bindings import PAGED_DECODE_ATTENTION


def decode_attention_available() -> bool:
    return PAGED_DECODE_ATTENTION.available()


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention_ref: q [B, H, D] -> [B, H, D]."""
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu":
        raise ValueError(f"the CPU kernel takes fp32 CPU tensors, not {q.dtype} on {q.device}")
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables, lens = block_tables.contiguous().to(torch.int64), seq_lens.contiguous().to(torch.int64)
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    status = PAGED_DECODE_ATTENTION(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, table_stride=tables.shape[1], seq_lens=lens,
        out=out, num_rows=batch, num_heads=num_heads, num_kv_heads=k_cache.shape[2], head_dim=head_dim,
        block_size=k_cache.shape[1], scale=scale, num_threads=torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the CPU decode attention kernel could not allocate its scratch scores")
    return out
