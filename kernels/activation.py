"""SiLU-and-mul: the SwiGLU gate on a fused gate_up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cadenza.kernels.triton_common import block_for


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


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
