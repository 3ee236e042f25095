"""Triton building blocks shared by the decode and extend attention kernels.

Both walk a request's keys in tiles of BLOCK_N positions, fetch each tile's K/V rows
through the block table (never a contiguous copy of the context), and fold the tile into
a running softmax: per query row a max `m`, a sum `l` and an unnormalised output `acc`.
Scores live in the log2 domain (the scale is pre-multiplied by log2 e) so exp2 is used.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def keys_per_tile(dtype: torch.dtype) -> int:
    """BLOCK_N: 64 keys per step amortise the block-table lookups; fp32 caches take 32 so the
    pipelined (3-stage) K and V tiles of head 128 still fit in a GPU's shared memory."""
    return 32 if dtype == torch.float32 else 64


@triton.jit
def paged_row_offsets(table_ptr, pos, valid, stride_block, stride_slot, BLOCK_SIZE: tl.constexpr):
    """Element offset of each key position's cache row (head 0, dim 0); int64, as caches outgrow 2^31."""
    block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    return block * stride_block + (pos % BLOCK_SIZE).to(tl.int64) * stride_slot


@triton.jit
def load_kv_tile(k_cache, v_cache, rows, valid, head_offset, offs_d, d_mask):
    """The K and V tiles [BLOCK_N, BLOCK_D] of one KV head; invalid positions read as zero."""
    ptrs = rows[:, None] + head_offset + offs_d[None, :]
    mask = valid[:, None] & d_mask[None, :]
    return tl.load(k_cache + ptrs, mask=mask, other=0.0), tl.load(v_cache + ptrs, mask=mask, other=0.0)


@triton.jit
def online_softmax_update(acc, m_i, l_i, s, v, PRECISION: tl.constexpr):
    """Fold scores s [R, N] (log2 domain, -inf where masked) and values v [N, D] into the state.

    Every row must see at least one key in its first folded tile, so m stays finite after it
    and `m_i - m_new` is never -inf - -inf."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    # P is rounded to V's dtype for the tensor-core dot, as the reference rounds its softmax.
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


def check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor) -> None:
    """The kernels index K and V with one set of strides and a unit-stride head dim."""
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share shape and strides, with a contiguous head dim")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3] or q.dtype != k_cache.dtype:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} does not fit caches {tuple(k_cache.shape)} {k_cache.dtype}")
