"""The fused-MoE Triton kernel: every (token, expert) pair of a batch in one grouped GEMM.

The pairs are sorted by expert and each expert's run is padded to a whole number of BLOCK_M
rows (align_blocks), so every row block belongs to one expert; a program reads its block's
expert id and multiplies its rows by that expert's weight tile. Two launches make a layer:
x @ W13[e]^T for the gate|up rows (rows gathered from x by token), SiLU-and-mul, then
h @ W2[e]^T scaled by the routing weight; the k partial rows of a token are summed last.
The weights are the layer's two fused [in, out] tensors (models/moe.py), read through strides,
so no per-expert copy exists; dense weights only (a packed format takes the grouped path).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.moe.routing import sort_by_expert
from cadenza.kernels.triton_common import dot_precision, dot_tile
from cadenza.kernels.triton_elementwise import silu_and_mul_triton

BLOCK_M = 16


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, block_expert): the pairs sorted by expert with each expert's run padded to a
    multiple of block_m by an out-of-range pair (T * k, masked in the kernel), and the
    expert of each block. Built on the device, with one host sync for the size."""
    pairs, counts = sort_by_expert(ids, num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    total = int(ends[-1])
    starts = ends - padded
    rows = torch.full((total,), ids.numel(), dtype=torch.int64, device=ids.device)
    # Each pair's place: its expert's padded start plus its rank within the expert's run.
    first_of_expert = torch.cumsum(counts, 0) - counts
    expert_of_pair = ids.flatten()[pairs]
    place = starts[expert_of_pair] + torch.arange(pairs.numel(), device=ids.device) - first_of_expert[expert_of_pair]
    rows[place] = pairs
    block_expert = torch.repeat_interleave(torch.arange(num_experts, device=ids.device), padded // block_m)
    return rows, block_expert


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    rows_ptr,
    block_expert_ptr,
    weight_ptr,
    out_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_wk,
    stride_om,
    TOP_K: tl.constexpr,  # a row of `a` per token (gather by pair // TOP_K), or 1: per pair
    SCALE: tl.constexpr,  # multiply each output row by its pair's routing weight
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.load(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    m_mask, n_mask = pairs < num_pairs, offs_n < N
    expert = tl.load(block_expert_ptr + block)
    a_rows = pairs // TOP_K
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a_tile = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        a = tl.load(a_tile, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_tile = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        w = tl.load(w_tile, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
    if SCALE:
        acc *= tl.load(weight_ptr + pairs, mask=m_mask, other=0.0)[:, None]
    out = out_ptr + pairs[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    rows: torch.Tensor,
    block_expert: torch.Tensor,
    routing: torch.Tensor,
    num_pairs: int,
    top_k: int,
    scale: bool,
) -> torch.Tensor:
    """out[pair] = a[pair // top_k] @ w[expert(pair)]^T (* routing[pair]); w is [E, N, K]."""
    _, n, k = w.shape
    out = torch.empty(num_pairs, n, dtype=a.dtype, device=a.device)
    block_n, block_k = min(dot_tile(n), 64), min(dot_tile(k), 64)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, rows, block_expert, routing, out, num_pairs, n, k,
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        TOP_K=top_k, SCALE=scale, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        PRECISION=dot_precision(a.dtype),
    )  # fmt: skip
    return out


def fused_moe_triton(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows per expert), w2 [E, H, I], any
    strides; routing weights / ids [T, k] -> [T, H]."""
    tokens, top_k = ids.shape
    x = x.contiguous()
    rows, block_expert = align_blocks(ids, w13.shape[0], BLOCK_M)
    routing = weights.flatten().float().contiguous()
    num_pairs = tokens * top_k
    gate_up = _grouped_gemm(x, w13, rows, block_expert, routing, num_pairs, top_k, scale=False)
    h = silu_and_mul_triton(gate_up)
    y = _grouped_gemm(h, w2, rows, block_expert, routing, num_pairs, 1, scale=True)
    return y.view(tokens, top_k, -1).sum(dim=1)


def fused_moe_ref(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The same contract in plain torch, one token and expert at a time."""
    out = torch.zeros_like(x)
    half = w13.shape[1] // 2
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            h = x[t] @ w13[e].T
            out[t] += ((torch.nn.functional.silu(h[:half]) * h[half:]) @ w2[e].T) * w
    return out
