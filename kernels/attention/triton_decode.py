"""Paged decode attention: one query token per request, split-KV ("flash-decoding").

One program owns (request, KV head, split): it loads the query rows of every head in that
KV head's group at once, so each K/V tile is read once per group, not once per query head.
The context is cut into `num_splits` partitions; each program folds its partition with an
online softmax, and a second kernel merges the partitions' (max, sum, output) triples. With
one split the first kernel normalises and writes the output itself. The split count and
partition length are runtime arguments, so they never cause a recompilation.
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
from cadenza.kernels.triton_common import block_for, dot_precision, dot_tile, num_sms

MIN_PARTITION = 256  # below this many keys a split costs more to merge than it saves
MAX_SPLITS = 64


def decode_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, sms: int) -> int:
    """How many partitions to cut each context into.

    Without splitting there are batch * num_kv_heads programs; when that is short of about
    two waves over the SMs, split long contexts until it is, keeping partitions at least
    MIN_PARTITION keys long. Large batches and short contexts get one split."""
    programs = batch * num_kv_heads
    if programs >= sms:
        return 1
    wanted = triton.cdiv(2 * sms, programs)
    return max(1, min(wanted, max_seq_len // MIN_PARTITION, MAX_SPLITS))


@triton.jit
def _decode_partition_kernel(
    q_ptr,
    k_cache,
    v_cache,
    tables_ptr,
    seq_lens_ptr,
    out_ptr,
    acc_ptr,
    m_ptr,
    l_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_table,
    stride_kb,
    stride_ks,
    stride_kh,
    qk_scale,
    partition,
    num_splits,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DIRECT: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)  # loop bounds and positions in one integer type
    lo = split * partition
    hi = tl.minimum(lo + partition, seq_len)  # hi <= lo: an empty partition (short context)

    offs_g, offs_d = tl.arange(0, BLOCK_G), tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_g
    g_mask, d_mask = offs_g < GROUP, offs_d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + req * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = tables_ptr + req.to(tl.int64) * stride_table
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        rows = paged_row_offsets(table, pos, valid, stride_kb, stride_ks, BLOCK_SIZE)
        k, v = load_kv_tile(k_cache, v_cache, rows, valid, kv_head * stride_kh, offs_d, d_mask)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        acc, m_i, l_i = online_softmax_update(acc, m_i, l_i, s, v, PRECISION)

    if DIRECT:  # one split: nothing to merge
        out = out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials are [B, H, S] (max, sum) and [B, H, S, D] (unnormalised output), fp32.
        part = (req * GROUP * tl.num_programs(1) + heads) * num_splits + split
        tl.store(m_ptr + part, m_i, mask=g_mask)
        tl.store(l_ptr + part, l_i, mask=g_mask)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=q_mask)


@triton.jit
def _decode_reduce_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req, head = tl.program_id(0), tl.program_id(1)
    offs_s, offs_d = tl.arange(0, BLOCK_S), tl.arange(0, BLOCK_D)
    s_mask, d_mask = offs_s < num_splits, offs_d < HEAD_DIM
    base = (req * tl.num_programs(1) + head) * num_splits
    m = tl.load(m_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    l_s = tl.load(l_ptr + base + offs_s, mask=s_mask, other=0.0)
    # Empty partitions carry m = -inf and weigh exp2(-inf) = 0; split 0 is never empty.
    weight = tl.exp2(m - tl.max(m, 0))
    acc = tl.load(
        acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_s * weight, 0)
    tl.store(out_ptr + req * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as paged_decode_attention_ref: q [B, H, D] -> [B, H, D].

    max_seq_len (the host-side max of seq_lens) saves a device sync; num_splits overrides
    the heuristic; out may be a view to write into (e.g. the decode rows of a mixed batch)."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    check_caches(k_cache, v_cache, q)
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if num_splits is None:
        num_splits = decode_num_splits(batch, num_kv_heads, max_seq_len, num_sms(q.device))
    # Partitions are whole tiles: only a context's last tile is partly masked.
    block_n = keys_per_tile(q.dtype)
    partition = triton.cdiv(triton.cdiv(max_seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(max_seq_len, partition)
    group = num_heads // num_kv_heads
    partials = _partials(batch, num_heads, num_splits, head_dim, q.device)
    _decode_partition_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        *partials,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        scale * LOG2E,
        partition,
        num_splits,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        DIRECT=num_splits == 1,
        BLOCK_G=dot_tile(group),
        BLOCK_D=dot_tile(head_dim),
        BLOCK_N=block_n,
        PRECISION=dot_precision(q.dtype),
    )
    if num_splits > 1:
        _decode_reduce_kernel[(batch, num_heads)](
            *partials,
            out,
            out.stride(0),
            out.stride(1),
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=block_for(num_splits),
            BLOCK_D=block_for(head_dim),
        )
    return out


def _partials(batch: int, heads: int, splits: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """(acc, max, sum) scratch for split-KV; one element each when there is nothing to merge."""
    if splits == 1:
        return tuple(torch.empty(1, device=device) for _ in range(3))
    acc = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=device)
    m = torch.empty(batch, heads, splits, dtype=torch.float32, device=device)
    return acc, m, torch.empty_like(m)
