"""Paged attention inputs: random caches, scattered non-contiguous blocks, block 0 poisoned."""

from __future__ import annotations

import torch

from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza_testkit.kernel_compare import DEVICE

# (query heads, KV heads): GQA ratios 1, 3, 4 and 8.
HEADS = [(2, 2), (6, 2), (4, 1), (16, 2)]


def paged_batch(
    seq_lens: list[int], q_lens: list[int], heads: tuple[int, int], head_dim: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """q, k_cache, v_cache and metadata for requests with these contexts and query runs."""
    num_heads, num_kv_heads = heads
    blocks_per_req = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_req) + 1
    order = (torch.randperm(num_blocks - 1) + 1).tolist()  # block 0 is never handed out
    width = max(blocks_per_req)
    tables = []
    for n in blocks_per_req:
        tables.append(order[:n] + [0] * (width - n))
        order = order[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE)
    k_cache[0], v_cache[0] = 8.0, 8.0
    q = torch.randn(sum(q_lens), num_heads, head_dim, device=DEVICE)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=DEVICE),  # attention does not write
        query_start_loc=qsl,
        seq_lens=seq_lens,
        seq_lens_tensor=torch.tensor(seq_lens, device=DEVICE),
        block_tables=torch.tensor(tables, device=DEVICE),
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),  # the leading 1-token runs
    )
    return q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta
