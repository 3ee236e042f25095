"""Rotary position embedding (rotate-half convention, as HF Llama/Qwen2)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.triton_common import block_for


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [T, K, D]; cos_sin [T, D], each token's row of the cache: cos, then sin.

    The model gathers the rows once per step, not once per layer."""
    half = cos_sin.shape[1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


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
