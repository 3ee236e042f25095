"""Quantizing a dense weight on load: int8 (symmetric, per output channel) and int4
(asymmetric, group-wise), into the PackedWeight layouts the kernels read."""

from __future__ import annotations

import torch

from cadenza.kernels.quant.weight import DENSE_KINDS, SUBBLOCK, PackedWeight

INT4_GROUP_SIZES = (32, 64, 128)


def quantize_int8(weight: torch.Tensor) -> PackedWeight:
    """w [rows, cols] -> q8 with one fp32 scale per row: w ~= q * scale, q in -127..127."""
    w = weight.float()
    amax = w.abs().amax(dim=1, keepdim=True)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))  # an all-zero row gets codes 0
    codes = (w / scales).round().clamp(-127, 127).to(torch.int8)
    return PackedWeight("q8", w.shape[0], w.shape[1], codes.contiguous(), group=w.shape[1], scales=scales)


def quantize_int4(weight: torch.Tensor, group: int) -> PackedWeight:
    """w [rows, cols] -> q4 with an fp16 scale and min per `group` elements of a row:
    w ~= q * scale + min, q in 0..15 (the group's [min, max] range in 15 steps)."""
    rows, cols = weight.shape
    if group not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group}")
    if cols % group:
        raise ValueError(f"int4 with group size {group} needs in-features divisible by it, got {cols}")
    w = weight.float().view(rows, cols // group, group)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    scales = torch.where(hi > lo, (hi - lo) / 15, torch.ones_like(hi)).half()
    mins = lo.half()
    # Codes from the stored (rounded) scale and min, so they fit what the kernels compute.
    codes = ((w - mins.float()[..., None]) / scales.float()[..., None]).round().clamp(0, 15).to(torch.uint8)
    return PackedWeight("q4", rows, cols, pack_nibbles(codes.view(rows, cols)), group, scales, mins)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [rows, cols] -> [rows, cols / 2]: per 32-element sub-block, element j
    low nibble of byte j, element j + 16 its high nibble (GGUF's Q4_0 / Q4_1 order)."""
    rows, cols = codes.shape
    sub = codes.view(rows, cols // SUBBLOCK, 2, SUBBLOCK // 2)
    return (sub[:, :, 0] | (sub[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse."""
    rows = packed.shape[0]
    sub = packed.view(rows, -1, SUBBLOCK // 2)
    return torch.stack((sub & 0xF, sub >> 4), dim=2).view(rows, -1)


def to_dense_kind(weight: torch.Tensor, kind: str) -> PackedWeight:
    """A dense weight kept as rows in the given dtype kind ("f32", "bf16", "f16")."""
    rows = weight.to(DENSE_KINDS[kind]).contiguous()
    return PackedWeight(kind, rows.shape[0], rows.shape[1], rows)


def quantize(weight: torch.Tensor, scheme: str, group: int) -> PackedWeight:
    """The on-load schemes by name: "int8" or "int4" (with its group size)."""
    if scheme == "int8":
        return quantize_int8(weight)
    if scheme == "int4":
        return quantize_int4(weight, group)
    raise ValueError(f"unknown quantization scheme {scheme!r}")
