"""Paged attention over a varlen batch: batched decode plus per-request prefill/extend.

The torch reference the Triton kernels are checked against. K/V are read only through
block tables, so prefix-cache hits, chunked prefill and decode share one path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from cadenza.kernels.attention.metadata import AttentionMetadata, DecodePlan


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len K (or V) rows of one request, [seq_len, K, D]."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    return cache[block_table[:num_blocks]].flatten(0, 1)[:seq_len]


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request. q [B, H, D] -> [B, H, D]; GQA by grouping query heads."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = -(-int(seq_lens.max()) // block_size)
    table = block_tables[:, :num_blocks]
    # [B, K, L, D] after the gather, in q's dtype (the cache may be narrower: kv_cache_dtype);
    # padded positions are masked below.
    k = k_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)
    v = v_cache[table].flatten(1, 2).transpose(1, 2).to(q.dtype)
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [B, K, G, L]
    positions = torch.arange(scores.shape[-1], device=q.device)
    pad = positions[None, :] >= seq_lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Padded positions are slots nobody wrote (a block's tail, or blocks past a shorter row):
    # their V is zeroed, not just weighted by 0, since 0 * NaN is NaN over an unwritten pool.
    v = v.masked_fill(pad[:, None, :, None], 0.0)
    return torch.matmul(probs, v).view(batch, num_heads, head_dim)


def prefill_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Q, H, D] are the last Q positions of a context k/v [L, K, D]; causal. -> [Q, H, D]."""
    q_len, ctx_len = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    if q_len == ctx_len:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at absolute position ctx_len - q_len + i and sees keys up to it.
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx_len - q_len)
        mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


# Extends of up to this many query tokens (speculative verification's k + 1, short extends
# after a prefix-cache hit) run as rows of the batched decode op, one row per query token with
# its own causal length, instead of one attention call per request: a batch of verifying
# requests is one op, not a Python loop (500 requests x 2 tokens: 52 ms vs 710 ms).
SHORT_EXTEND_TOKENS = 16


DecodeOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# (q, k_cache, v_cache, meta, requests, scale, out): writes the rows of out for these requests.
LongOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, list[int], float, torch.Tensor], None]


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    requests: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Each listed request's query tokens as its own causal attention over its context,
    into the same rows of out: the context gathered out of the cache, then SDPA."""
    qsl = meta.query_start_loc
    for i in requests:
        start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens[i]
        k = gather_kv(k_cache, meta.block_tables[i], seq_len).to(q.dtype)
        v = gather_kv(v_cache, meta.block_tables[i], seq_len).to(q.dtype)
        out[start:end] = prefill_attention_ref(q[start:end], k, v, scale)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode: DecodeOp = paged_decode_attention_ref,
    long: LongOp = paged_prefill_attention_ref,
) -> torch.Tensor:
    """Attention for every token of a varlen batch. q [T, H, D] -> [T, H, D].

    `decode` runs the one-query rows (decodes and short extends), `long` the longer extends
    and prefills; the C kernels of attention/cpu.py have the same contracts."""
    plan = meta.decode_plan if meta.decode_plan is not None else _plan_decode_rows(meta, q.device)
    meta.decode_plan = plan  # every layer of the step shares it
    if plan.index is None:  # every token is a decode row, in order
        return decode(q, k_cache, v_cache, plan.block_tables, plan.seq_lens, scale)
    out = torch.empty_like(q)
    if len(plan.index):
        out[plan.index] = decode(q[plan.index], k_cache, v_cache, plan.block_tables, plan.seq_lens, scale)
    if plan.long:
        long(q, k_cache, v_cache, meta, plan.long, scale, out)
    return out


def _plan_decode_rows(meta: AttentionMetadata, device: torch.device) -> DecodePlan:
    qsl = meta.query_start_loc
    rows, reqs, lens, long = [], [], [], []
    for i in range(meta.num_reqs):
        start, end, seq_len = qsl[i], qsl[i + 1], meta.seq_lens[i]
        if end - start > SHORT_EXTEND_TOKENS:
            long.append(i)
            continue
        # Query token t of the request sits at position seq_len - (end - t) and sees keys up to it.
        rows += range(start, end)
        reqs += [i] * (end - start)
        lens += range(seq_len - (end - start) + 1, seq_len + 1)
    seq_lens = torch.tensor(lens, dtype=torch.int64, device=device)
    if reqs == list(range(meta.num_reqs)):  # one row per request: its table as it is
        tables = meta.block_tables
    else:
        tables = meta.block_tables[torch.tensor(reqs, dtype=torch.int64, device=device)]
    # Without long extends the rows are every token, in order: no gather or scatter of q.
    index = None if not long else torch.tensor(rows, dtype=torch.int64, device=device)
    return DecodePlan(index, tables, seq_lens, long)
