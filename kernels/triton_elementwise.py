"""The Triton kernels of the element-wise ops (SiLU-and-mul, fused add + RMSNorm, rotary, the
KV write): each matches its torch reference in activation.py, norm.py, rotary.py and
kv_write.py. Kept apart from those so a CPU host imports no Triton (kernels/ops.py binds the
triton bundle only when it is asked for; a host without a Triton wheel serves on `cpu`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.triton_common import block_for


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(out_ptr + row * inter + cols, silu * up, mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    inter = x.shape[-1] // 2
    rows = x.numel() // x.shape[-1]
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    block = min(block_for(inter), 1024)
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, inter, BLOCK=block)
    return out


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RES:
        # Round the sum to the storage dtype first, as the reference's `x + residual` does.
        x = x + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (xf * inv).to(x.dtype) * w
    tl.store(out_ptr + row * n_cols + cols, y, mask=mask)


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One program per row; with residual None it is the plain RMSNorm (residual out = x)."""
    x = x.contiguous()
    rows, cols = x.reshape(-1, x.shape[-1]).shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res_in = residual.contiguous() if residual is not None else x
    _add_rms_norm_kernel[(rows,)](
        x, res_in, weight, out, res_out, cols, eps, HAS_RES=residual is not None, BLOCK=block_for(cols)
    )
    return out, res_out


@triton.jit
def _rotary_kernel(x_ptr, cs_ptr, out_ptr, stride_t, stride_h, heads, HALF: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    src = x_ptr + token * stride_t + head * stride_h
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    cos = tl.load(cs_ptr + token * 2 * HALF + offs, mask=mask, other=0.0).to(x1.dtype)
    sin = tl.load(cs_ptr + token * 2 * HALF + HALF + offs, mask=mask, other=0.0).to(x1.dtype)
    dst = out_ptr + (token * heads + head) * 2 * HALF
    tl.store(dst + offs, x1 * cos - x2 * sin, mask=mask)
    tl.store(dst + HALF + offs, x2 * cos + x1 * sin, mask=mask)


def _rotate_triton(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    if x.stride(2) != 1:
        x = x.contiguous()
    half = dim // 2
    _rotary_kernel[(tokens, heads)](
        x, cos_sin.contiguous(), out, x.stride(0), x.stride(1), heads, HALF=half, BLOCK=block_for(half)
    )
    return out


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rotary_ref; q and k may be strided views of the fused qkv output."""
    return _rotate_triton(q, cos_sin), _rotate_triton(k, cos_sin)


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_h,
    row,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    offs = tl.arange(0, BLOCK)
    mask = offs < row
    head, d = offs // HEAD_DIM, offs % HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_h + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_h + d, mask=mask)
    tl.store(kc_ptr + slot * row + offs, k, mask=mask)
    tl.store(vc_ptr + slot * row + offs, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """One program per token copies its K and V rows (all KV heads) into the flat slot."""
    tokens, heads, dim = key.shape
    if key.stride(2) != 1 or value.stride(2) != 1 or key.stride(1) != value.stride(1):
        key, value = key.contiguous(), value.contiguous()
    _write_kv_kernel[(tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        key.stride(1),
        heads * dim,
        HEAD_DIM=dim,
        BLOCK=block_for(heads * dim),
    )
