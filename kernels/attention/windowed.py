"""Attention with a sliding window and logit soft-capping (Mistral, Gemma 2/3), as torch.

A windowed layer's query at position p sees keys p - window < k <= p; soft-capping bounds
each score as tanh(s / cap) * cap before the softmax (Gemma 2). One request at a time, its
context gathered from the block table: only the blocks the window can reach are read, so a
long conversation costs a windowed layer the window, not the whole context. Every backend
runs these layers here (the fused kernels have no window or cap); a window that does not
bite (the whole batch within it) takes the backend's own paged attention instead
(models/llama.py), so Mistral within its window keeps the fast path.
"""

from __future__ import annotations

import torch

from cadenza.kernels.attention.metadata import AttentionMetadata


def _gather(cache: torch.Tensor, table: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """K (or V) rows [first, end) of one request, [end - first, K, D]."""
    block_size = cache.shape[1]
    start_block, end_block = first // block_size, -(-end // block_size)
    rows = cache[table[start_block:end_block]].flatten(0, 1)
    offset = start_block * block_size
    return rows[first - offset : end - offset]


def windowed_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """q [T, H, D] of a varlen batch -> [T, H, D]; causal, GQA by grouping query heads."""
    out = torch.empty_like(q)
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    group = q.shape[1] // num_kv_heads
    for i in range(meta.num_reqs):
        start, end, seq_len = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
        q_len = end - start
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)  # the earliest key any query sees
        table = meta.block_tables[i]
        k = _gather(k_cache, table, first, seq_len).to(q.dtype).permute(1, 0, 2)[:, None]  # [K, 1, L, D]
        v = _gather(v_cache, table, first, seq_len).to(q.dtype).permute(1, 0, 2)[:, None]
        qg = q[start:end].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [K, G, Q, D]
        scores = torch.matmul(qg, k.transpose(-1, -2)) * scale  # [K, G, Q, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[start:end] = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(q_len, -1, head_dim)
    return out
