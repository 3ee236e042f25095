"""The torch reference: any PackedWeight expanded to fp32 [rows, cols], for tests and for
hosts without the C kernels (dequantize a tile, then matmul)."""

from __future__ import annotations

import torch

from cadenza.kernels.quant.quantize import unpack_nibbles
from cadenza.kernels.quant.weight import DENSE_KINDS, SUPERBLOCK, PackedWeight


def dequantize(w: PackedWeight, start: int = 0, end: int | None = None) -> torch.Tensor:
    """Rows [start, end) of w as fp32."""
    end = w.rows if end is None else end
    data = w.data[start:end]
    if w.kind in DENSE_KINDS:
        return data.float()
    if w.kind == "q8":
        return _grouped(data.float(), w.scales[start:end], None, w.group)
    if w.kind == "q4":
        codes = unpack_nibbles(data).float()
        if w.mins is None:
            return _grouped(codes - 8, w.scales[start:end], None, w.group)
        return _grouped(codes, w.scales[start:end], w.mins[start:end], w.group)
    if w.kind == "q4_k":
        return _q4_k(data.view(end - start, -1, 144)).view(end - start, w.cols)
    return _q6_k(data.view(end - start, -1, 210)).view(end - start, w.cols)


def packed_matmul_ref(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: dequantize to x's dtype, then a plain matmul (+ bias)."""
    y = x @ dequantize(w).to(x.dtype).T
    return y if bias is None else y + bias


def round_activations_ref(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded to int8 per block of 32 along K (scale = the block's max / 127), as
    the q4 / q8 kernels read it: csrc/packed_linear.c's round_activations in torch."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return (torch.round(blocks * inverse) * scale).reshape(x.shape)


def _grouped(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, group: int) -> torch.Tensor:
    rows, cols = codes.shape
    g = codes.view(rows, cols // group, group) * scales.float()[..., None]
    if mins is not None:
        g = g + mins.float()[..., None]
    return g.view(rows, cols)


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[..., start : start + 2].contiguous().view(torch.float16).float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    """[rows, n, 144] super-blocks: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for
    8 sub-blocks of 32, then 128 bytes of codes (each 32 bytes: one sub-block in the low
    nibbles, the next in the high); w = d * scale * q - dmin * min."""
    d, dmin = _fp16(b, 0), _fp16(b, 2)
    s = b[..., 4:16].long()
    low, high, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scale = torch.cat([low & 63, (mix & 15) | ((low >> 6) << 4)], dim=-1)
    minimum = torch.cat([high & 63, (mix >> 4) | ((high >> 6) << 4)], dim=-1)
    qs = b[..., 16:].view(*b.shape[:-1], 4, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=-2).view(*b.shape[:-1], 8, 32).float()
    w = (d * scale.float())[..., None] * codes - (dmin * minimum.float())[..., None]
    return w.flatten(-2)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    """[rows, n, 210] super-blocks: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
    scales (one per 16 weights), fp16 d; w = d * scale * (q - 32), q 6 bits. Element
    128 h + 32 t + e takes nibble t // 2 of ql[64 h + 32 (t % 2) + e] and bits 2t of qh[32 h + e]."""
    lead = b.shape[:-1]
    ql = b[..., :128].view(*lead, 2, 1, 2, 32)
    qh = b[..., 128:192].view(*lead, 2, 1, 32)
    low = torch.cat([ql & 15, ql >> 4], dim=-3).view(*lead, 2, 4, 32)  # [h, t, e], t = 2 * nibble + half
    high = torch.cat([(qh >> (2 * t)) & 3 for t in range(4)], dim=-2)
    q = (low | (high << 4)).float() - 32
    scales = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _fp16(b, 208)
    w = q.view(*lead, SUPERBLOCK // 16, 16) * (d * scales)[..., None]
    return w.flatten(-2)
