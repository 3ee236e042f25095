"""Prefill/extend attention: varlen query runs over paged K/V, causal within each context.

Request i's query tokens [qsl[i], qsl[i+1]) are the last q_len positions of its context of
seq_lens[i] keys (a full prefill, a chunk after a prefix-cache hit or earlier chunks, or the
k+1 tokens of a speculative verification). All such requests go in one launch over
(row tile, KV head, request); per-request offsets come from device tensors.

GQA: a tile's rows are (token, head-in-group) pairs of one KV head, BLOCK_R // GROUP tokens
times GROUP heads, so a K/V tile loaded from the cache serves the whole group.
FlashAttention-style: keys are walked in BLOCK_N tiles with an online softmax; keys every
row may see run unmasked, only the tiles along the causal diagonal are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.attention.triton_tile import (
    LOG2E,
    check_caches,
    keys_per_tile,
    load_kv_tile,
    online_softmax_update,
    paged_row_offsets,
)
from cadenza.kernels.triton_common import dot_precision, dot_tile


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache,
    v_cache,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    first_req,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_kb,
    stride_ks,
    stride_kh,
    qk_scale,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # Causal tiles further down a prompt see more keys: start those first so the cheap ones
    # fill the tail of the launch.
    tile, kv_head = tl.num_programs(0) - 1 - tl.program_id(0), tl.program_id(1)
    req = first_req + tl.program_id(2)
    q_start = tl.load(qsl_ptr + req).to(tl.int32)
    q_len = tl.load(qsl_ptr + req + 1).to(tl.int32) - q_start
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    ctx_start = seq_len - q_len  # absolute position of this request's first query token

    tokens_per_tile = BLOCK_R // GROUP
    t0 = tile * tokens_per_tile
    offs_r, offs_d = tl.arange(0, BLOCK_R), tl.arange(0, BLOCK_D)
    tok = t0 + offs_r // GROUP
    heads = kv_head * GROUP + offs_r % GROUP
    r_mask = (offs_r < tokens_per_tile * GROUP) & (tok < q_len)
    d_mask = offs_d < HEAD_DIM
    rd_mask = r_mask[:, None] & d_mask[None, :]
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=rd_mask, other=0.0
    )
    q_pos = ctx_start + tok

    # Keys below `full` are seen by every row (they precede the tile's first query); keys up to
    # the tile's last query position need the causal mask. A tile past q_len does nothing.
    last_tok = tl.minimum(t0 + tokens_per_tile, q_len) - 1
    hi = tl.where(t0 < q_len, ctx_start + last_tok + 1, 0)
    full = tl.minimum((ctx_start + t0 + 1) // BLOCK_N * BLOCK_N, hi)

    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    table = tables_ptr + req.to(tl.int64) * stride_table
    head_offset = kv_head * stride_kh
    for start in range(0, full, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < full
        rows = paged_row_offsets(table, pos, valid, stride_kb, stride_ks, BLOCK_SIZE)
        k, v = load_kv_tile(k_cache, v_cache, rows, valid, head_offset, offs_d, d_mask)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, PRECISION)
    for start in range(full, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        rows = paged_row_offsets(table, pos, valid, stride_kb, stride_ks, BLOCK_SIZE)
        k, v = load_kv_tile(k_cache, v_cache, rows, valid, head_offset, offs_d, d_mask)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(seen, s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, PRECISION)

    l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past q_len saw no key; they are not stored
    out = out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=rd_mask)


def extend_tile_sizes(group: int, head_dim: int, max_q_len: int, dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_N): query rows (tokens x group heads) and keys per tile.

    On a GPU 128 rows x 64 keys of head 128 in 16-bit (the FlashAttention-2 shape) fit the
    accumulator in registers and the Q, K, V tiles in shared memory; wider heads and fp32
    halve the rows. Short queries (verification, q_len of a few tokens) shrink the row tile
    so fewer rows are padding. The interpreter gets the same shapes."""
    cap = 128 if head_dim <= 128 and dtype != torch.float32 else 64
    rows = min(dot_tile(max_q_len * group), cap)
    return max(rows, dot_tile(group)), keys_per_tile(dtype)  # at least one token's whole group


def extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    first_req: int,
    num_reqs: int,
    max_q_len: int,
    scale: float,
) -> torch.Tensor:
    """Attention for requests first_req .. first_req + num_reqs - 1 of a varlen batch.

    q and out are [T, H, D] for the whole batch (rows are picked by query_start_loc, int32 or
    int64 on q's device, [num_reqs_total + 1]); max_q_len is the longest query run among
    these requests, known on the host. Writes the requests' rows of out and returns it."""
    check_caches(k_cache, v_cache, q)
    if num_reqs == 0 or max_q_len == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    block_r, block_n = extend_tile_sizes(group, head_dim, max_q_len, q.dtype)
    tiles = triton.cdiv(max_q_len, block_r // group)
    _extend_kernel[(tiles, num_kv_heads, num_reqs)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        first_req,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * LOG2E,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_R=block_r,
        BLOCK_D=dot_tile(head_dim),
        BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype),
        num_warps=8 if block_r >= 128 else 4,
    )
    return out
