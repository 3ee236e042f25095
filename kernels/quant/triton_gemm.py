"""Triton GEMMs over packed weights: y = x @ W.T (+ bias) with W a q8 or q4 PackedWeight
(weight.py), read as stored, never expanded in memory.

q8: int8 codes [N, K] and fp32 scales [N, K / group], group = K (on-load int8, one scale per
output channel) or 32 (GGUF Q8_0). q4: nibbles [N, K / 2] in GGUF's sub-block order, fp16
scales and mins [N, K / group] (group 32-128; GGUF Q4_1 and on-load int4), or scales alone
with codes offset by 8 (GGUF Q4_0); so one kernel reads GGUF's Q4_0 / Q4_1 blocks and int4.

Each weight tile is dequantized in registers inside a tiled matmul: the integer codes
(exact in fp16/bf16) go through tl.dot in the activation dtype and the scale is applied to
the fp32 partial sum, once per output channel for per-channel q8 and per K tile otherwise (a
tile never spans two groups: BLOCK_K divides the group). q4's mins need no dequantized tile
either: sum_k x_k (q_k s + m) = s (x . q) + m sum_k x_k, so the tile's row sums of x times
the min go on the sum too. The weight is read once, at 1 or 1/2 byte per element plus its
scales, which is what decode (a GEMV streaming the whole weight) is bound by.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.quant.weight import SUBBLOCK, TRITON_KINDS, PackedWeight
from cadenza.kernels.triton_common import dot_precision, dot_tile

MAX_BLOCK_K = 128


@triton.jit
def _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """The fp32 tile (+ bias, added before the one rounding to the output dtype) stored."""
    m_mask, n_mask = offs_m < M, offs_n < N
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _q8_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,  # elements per scale; 0: one scale per output channel
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # Per-channel K is any width (masked); grouped K is whole groups, masked only for uniformity.
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        # The weight tile is read as [K, N] (a transposed view of the [N, K] rows): no tl.trans.
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0)
        part = tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
        if GROUP == 0:
            acc += part
        else:
            scale = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_mask, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
    if GROUP == 0:  # one multiply per output rather than per tile
        acc *= tl.load(s_ptr + offs_n * stride_sn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


@triton.jit
def _q4_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    GROUP: tl.constexpr,
    HAS_MINS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # Each byte is loaded once and split into two [K/2, N] code tiles, each multiplied by the
    # x columns it stands for: byte b of a tile holds element b + 16 (b // 16) of the tile in
    # its low nibble and the element 16 further in its high one (GGUF's sub-block order).
    offs_b = tl.arange(0, BLOCK_K // 2)
    offs_lo = offs_b + (offs_b // 16) * 16
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    w_cols = w_ptr + offs_n[None, :] * stride_wn
    # K is whole groups and BLOCK_K divides the group: no K mask, one group per tile.
    for k0 in range(0, K, BLOCK_K):
        x_lo = tl.load(x_rows + (k0 + offs_lo)[None, :], mask=m_mask[:, None], other=0.0)
        x_hi = tl.load(x_rows + (k0 + 16 + offs_lo)[None, :], mask=m_mask[:, None], other=0.0)
        byte = tl.load(w_cols + (k0 // 2 + offs_b)[:, None], mask=n_mask[None, :], other=0)
        lo, hi = (byte & 0xF).to(tl.int32), (byte >> 4).to(tl.int32)
        if not HAS_MINS:  # Q4_0's codes are offset by 8; q - 8 in -8..7 is still exact
            lo, hi = lo - 8, hi - 8
        part = tl.dot(x_lo, lo.to(x_lo.dtype), input_precision=PRECISION)
        part += tl.dot(x_hi, hi.to(x_hi.dtype), input_precision=PRECISION)
        group = k0 // GROUP
        scale = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        acc += part * scale[None, :]
        if HAS_MINS:
            minimum = tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
            x_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
            acc += x_sum[:, None] * minimum[None, :]
    _store_tile(acc, b_ptr, out_ptr, offs_m, offs_n, M, N, stride_om, HAS_BIAS)


def gemm_tiles(m: int, n: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N). Small M (decode) is a GEMV reading the whole weight: narrow N tiles
    give enough programs to keep every SM streaming (N=4096 -> 128 programs); larger M uses
    64 x 64 tiles that reuse each weight tile across more rows."""
    block_m = min(dot_tile(m), 64)
    return block_m, 32 if m <= 16 else min(64, dot_tile(n))


def _flatten(x: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """x [..., K] as a row-major [M, K] matrix with unit stride along K, and the leading shape."""
    x2 = x.reshape(-1, x.shape[-1])
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), x.shape[:-1]


def _group_block_k(w: PackedWeight, smallest: int) -> int:
    """BLOCK_K for a grouped weight: the group up to MAX_BLOCK_K, so a tile holds one group."""
    g = w.group
    if g < smallest or g & (g - 1) or w.cols % g:
        raise ValueError(f"{w.kind} group size {g} must be a power of two >= {smallest} dividing K={w.cols}")
    return min(g, MAX_BLOCK_K)


def _launch_q8(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    (m, k), n = x.shape, w.rows
    per_channel = w.group == w.cols
    block_k = min(dot_tile(k), MAX_BLOCK_K) if per_channel else _group_block_k(w, 16)
    data, scales = w.data.contiguous(), w.scales.contiguous()
    block_m, block_n = gemm_tiles(m, n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _q8_kernel[grid](
        x,
        data,
        scales,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        x.stride(0),
        data.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP=0 if per_channel else w.group,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
    )


def _launch_q4(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    (m, k), n = x.shape, w.rows
    block_k = _group_block_k(w, SUBBLOCK)  # a tile is whole sub-blocks
    # Scales and mins share one row stride, as they share a shape.
    data, scales = w.data.contiguous(), w.scales.contiguous()
    mins = scales if w.mins is None else w.mins.contiguous()
    block_m, block_n = gemm_tiles(m, n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _q4_kernel[grid](
        x,
        data,
        scales,
        mins,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        x.stride(0),
        data.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP=w.group,
        HAS_MINS=w.mins is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION=dot_precision(x.dtype),
    )


_LAUNCHERS = {"q8": _launch_q8, "q4": _launch_q4}


def packed_matmul_triton(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as packed_matmul_ref, for w of a kind in TRITON_KINDS; out in x's dtype."""
    launch = _LAUNCHERS.get(w.kind)
    if launch is None:
        raise ValueError(f"no Triton GEMM reads {w.kind!r} weights (it reads {', '.join(TRITON_KINDS)})")
    x2, lead = _flatten(x)
    if x2.shape[1] != w.cols:
        raise ValueError(f"x has {x2.shape[1]} features, the {w.kind} weight {w.cols}")
    out = torch.empty(x2.shape[0], w.rows, dtype=x.dtype, device=x.device)
    if x2.shape[0]:  # an empty grid is not a launch
        launch(x2, w, None if bias is None else bias.contiguous(), out)
    return out.view(*lead, w.rows)
