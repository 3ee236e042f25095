"""Weight-only quantized GEMMs: y = x @ W.T with W stored as int8 (W8A16) or int4 (W4A16).

W8A16: int8 weights [N, K], symmetric, one scale per output channel [N].
W4A16: asymmetric groups of `group_size` along K, values 0..15 packed two per uint8 byte
along K (byte j of a row holds k = 2j in its low and k = 2j + 1 in its high nibble), one
scale and one integer zero point per (row, group): [N, K // group_size] each.
Scales are stored in the weight's dtype; zero points as uint8.

The Triton kernels dequantize each weight tile in registers inside a tiled matmul: the
integer codes (exact in fp16/bf16) go through the dot and the scale is applied to the fp32
partial sum, per output channel for W8A16 and per K tile for W4A16 (a tile never spans two
groups). The weight is read once, at 1 or 1/2 byte per element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.triton_common import dot_precision, dot_tile


def quantize_w8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (int8 codes [N, K], scales [N]) with w ~= code * scale."""
    w = weight.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127, 1.0).to(weight.dtype)  # an all-zero row gets codes 0
    # Codes come from the stored (rounded) scale, so dequantizing reproduces them exactly.
    qweight = (w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    return qweight, scales


def quantize_w4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (packed uint8 [N, K/2], scales [N, K/G], zeros uint8 [N, K/G]).

    w ~= (code - zero) * scale per group. The group's range is widened to include 0 so the
    zero point is a code in 0..15 and an all-zero group dequantizes to exact zeros."""
    rows, cols = weight.shape
    if cols % group_size or group_size % 2:
        raise ValueError(f"K={cols} must be a multiple of the (even) group size {group_size}")
    w = weight.float().view(rows, cols // group_size, group_size)
    lo, hi = w.amin(dim=2).clamp_max(0), w.amax(dim=2).clamp_min(0)
    scales = torch.where(hi > lo, (hi - lo) / 15, 1.0).to(weight.dtype)  # hi == lo only for all zeros
    s = scales.float()
    zeros = (-lo / s).round().clamp(0, 15)
    codes = ((w / s[..., None]).round() + zeros[..., None]).clamp(0, 15).to(torch.uint8).view(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, scales, zeros.to(torch.uint8)


def dequantize_w8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] the codes stand for."""
    return qweight.float() * scales.float()[:, None]


def dequantize_w4(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """The fp32 weight [N, K] the packed codes stand for."""
    rows = packed.shape[0]
    codes = torch.stack((packed & 0xF, packed >> 4), dim=2).view(rows, -1, group_size).float()
    return ((codes - zeros.float()[..., None]) * scales.float()[..., None]).view(rows, -1)


def w8a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N]: dequantize to x's dtype, then a plain matmul."""
    return x @ dequantize_w8(qweight, scales).to(x.dtype).T


def w4a16_matmul_ref(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [..., K] -> [..., N]: dequantize to x's dtype, then a plain matmul."""
    return x @ dequantize_w4(packed, scales, zeros, group_size).to(x.dtype).T


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x_mask = m_mask[:, None] & k_mask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
        # The weight tile is read as [K, N] (a transposed view of the [N, K] rows): no tl.trans.
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=w_mask, other=0)
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    scale = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    out = (acc * scale[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _w4a16_kernel(
    x_ptr,
    p_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # K is a multiple of GROUP_SIZE and BLOCK_K divides it: no K mask, one group per tile.
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None], other=0.0)
        # Each byte is loaded for both of its k (the second hit is a cache hit) and the nibble
        # picked by k's parity; the tile is [K, N].
        byte = tl.load(p_ptr + offs_n[None, :] * stride_pn + (offs_k // 2)[:, None], mask=n_mask[None, :], other=0)
        code = (byte.to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF
        group = k0 // GROUP_SIZE
        zero = tl.load(z_ptr + offs_n * stride_sn + group, mask=n_mask, other=0).to(tl.int32)
        scale = tl.load(s_ptr + offs_n * stride_sn + group, mask=n_mask, other=0.0).to(tl.float32)
        # code - zero lies in -15..15, exact in any float dtype; the scale goes on the fp32 sum.
        w = (code - zero[None, :]).to(x.dtype)
        acc += tl.dot(x, w, input_precision=PRECISION) * scale[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], out, mask=m_mask[:, None] & n_mask[None, :])


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


def w8a16_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Same contract as w8a16_matmul_ref."""
    x2, lead = _flatten(x)
    (m, k), n = x2.shape, qweight.shape[0]
    qweight = qweight.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n = gemm_tiles(m, n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a16_kernel[grid](
        x2,
        qweight,
        scales,
        out,
        m,
        n,
        k,
        x2.stride(0),
        qweight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(dot_tile(k), 128),
        PRECISION=dot_precision(x.dtype),
    )
    return out.view(*lead, n)


def w4a16_matmul_triton(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Same contract as w4a16_matmul_ref; group_size is a power of two of at least 16."""
    x2, lead = _flatten(x)
    (m, k), n = x2.shape, packed.shape[0]
    if k % group_size or group_size < 16 or group_size & (group_size - 1):
        raise ValueError(f"group size {group_size} must be a power of two >= 16 dividing K={k}")
    packed, scales, zeros = packed.contiguous(), scales.contiguous(), zeros.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n = gemm_tiles(m, n)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w4a16_kernel[grid](
        x2,
        packed,
        scales,
        zeros,
        out,
        m,
        n,
        k,
        x2.stride(0),
        packed.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=min(group_size, 128),
        PRECISION=dot_precision(x.dtype),
    )
    return out.view(*lead, n)
