"""RMSNorm, plain and fused with the residual add: torch reference and Triton kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.triton_common import block_for


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32 and cast back before the weight, as HF Llama does (bit-for-bit order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the residual stream and the next layer's input."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


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
