"""Attention with a sliding window and logit soft-capping (Mistral, Gemma 2/3), as torch.

A windowed layer's query at position p sees keys p - window < k <= p; soft-capping bounds
each score as tanh(s / cap) * cap before the softmax (Gemma 2). The batch splits as the
reference's does (reference.paged_attention_ref's plan): the one-query rows (decodes, short
extends) run as one batched op over each row's window only (its block table read from the
window's first block, so a row gathers about window / block_size blocks however long its
context), the long extends and prefills one request at a time over the blocks their windows
reach. So a long conversation costs a windowed layer the window, not the whole context.
Every backend runs these layers here (the fused kernels have no window or cap); a window
that does not bite (the whole batch within it) takes the backend's own paged attention
instead (models/llama.py), so Mistral within its window keeps the fast path.
"""

from __future__ import annotations

from functools import partial

import torch

from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.attention.reference import paged_attention_ref


def _first_keys(seq_lens: torch.Tensor, query_lens: torch.Tensor | int, window: int | None) -> torch.Tensor:
    """The earliest key any of a row's queries sees (its first query sits at seq_len - q_len)."""
    if window is None:
        return torch.zeros_like(seq_lens)
    return (seq_lens - query_lens - window + 1).clamp(min=0)


def _capped_softmax(scores: torch.Tensor, allowed: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)


def windowed_decode_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per row, q [R, H, D] -> [R, H, D] (the decode op's contract), each row over
    the blocks from its window's first one."""
    rows, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    first = _first_keys(seq_lens, 1, window)
    first_block = first // block_size
    span = int(((seq_lens + block_size - 1) // block_size - first_block).max())
    index = (first_block[:, None] + torch.arange(span, device=q.device)[None]).clamp(max=block_tables.shape[1] - 1)
    table = torch.gather(block_tables, 1, index)
    k = k_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)  # [R, K, L, D]
    v = v_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)
    positions = first_block[:, None] * block_size + torch.arange(span * block_size, device=q.device)[None]
    allowed = (positions < seq_lens[:, None]) & (positions >= first[:, None])  # [R, L]
    qg = q.view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim)
    probs = _capped_softmax(torch.matmul(qg, k.transpose(-1, -2)) * scale, allowed[:, None, None, :], softcap)
    # Unread slots (a block's tail, blocks past a row's end) may hold NaN: zero them, not just weight them by 0.
    v = v.masked_fill(~allowed[:, None, :, None], 0.0)
    return torch.matmul(probs, v).view(rows, num_heads, head_dim)


def _gather(cache: torch.Tensor, table: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """K (or V) rows [first, end) of one request, [end - first, K, D]."""
    block_size = cache.shape[1]
    start_block, end_block = first // block_size, -(-end // block_size)
    rows = cache[table[start_block:end_block]].flatten(0, 1)
    offset = start_block * block_size
    return rows[first - offset : end - offset]


def windowed_long_requests(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    requests: list[int],
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Each listed request's queries (a prefill or long extend) over the keys its window reaches."""
    num_kv_heads, head_dim = k_cache.shape[2], q.shape[2]
    group = q.shape[1] // num_kv_heads
    for i in requests:
        start, end, seq_len = meta.query_start_loc[i], meta.query_start_loc[i + 1], meta.seq_lens[i]
        q_len = end - start
        first = 0 if window is None else max(0, seq_len - q_len - window + 1)  # the earliest key seen
        table = meta.block_tables[i]
        k = _gather(k_cache, table, first, seq_len).to(q.dtype).permute(1, 0, 2)[:, None]  # [K, 1, L, D]
        v = _gather(v_cache, table, first, seq_len).to(q.dtype).permute(1, 0, 2)[:, None]
        qg = q[start:end].view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # [K, G, Q, D]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(first, seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        probs = _capped_softmax(torch.matmul(qg, k.transpose(-1, -2)) * scale, allowed, softcap)
        out[start:end] = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(q_len, -1, head_dim)


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
    decode = partial(windowed_decode_rows, window=window, softcap=softcap)
    long = partial(windowed_long_requests, window=window, softcap=softcap)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, decode=decode, long=long)
