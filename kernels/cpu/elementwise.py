"""The per-token ops between the GEMMs in C (csrc/elementwise.c), fp32 CPU tensors: the `cpu`
backend's fused residual-add + RMSNorm, rotary embedding and SiLU-and-mul, one call each
where torch takes 3-8 small ops."""

from __future__ import annotations

import torch

from cadenza.kernels.cpu.bindings import ADD_RMS_NORM, ROTARY, SILU_AND_MUL


def elementwise_available() -> bool:
    return ADD_RMS_NORM.available()


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as norm.fused_add_rms_norm_triton (residual None: plain RMSNorm)."""
    x, weight = x.contiguous(), weight.contiguous()
    residual = residual.contiguous() if residual is not None else None
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x  # unused by C without a residual
    cols = x.shape[-1]
    ADD_RMS_NORM(
        x=x, res=residual, w=weight, out=out, res_out=res_out, rows=x.numel() // cols, cols=cols, eps=eps,
        num_threads=torch.get_num_threads(),
    )  # fmt: skip
    return out, res_out


def _rotate_cpu(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    if x.stride(2) != 1:
        x = x.contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    ROTARY(
        x=x, stride_t=x.stride(0), stride_h=x.stride(1), cos_sin=cos_sin, out=out, tokens=tokens, heads=heads,
        half=dim // 2, num_threads=torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary_cpu(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rotary.rotary_ref; q and k may be strided views of the fused qkv output."""
    cos_sin = cos_sin.contiguous().float()
    return _rotate_cpu(q, cos_sin), _rotate_cpu(k, cos_sin)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    SILU_AND_MUL(x=x, out=out, rows=x.numel() // x.shape[-1], inter=inter, num_threads=torch.get_num_threads())
    return out
