"""One function per hot op; the model calls only these.

Each dispatches to the backend in CADENZA_KERNELS (`torch`, `cpu` or `triton`; see
backend.py), read per call so a test can switch it; the default is triton on CUDA and cpu on
the CPU. `torch` is the pure torch reference; `cpu` runs fp32 CPU tensors through the C
kernels instead: decode attention (one-query rows, attention/cpu.py) reading K/V in place
rather than gathering a padded copy, and the norm, rotary and SiLU ops (cpu/elementwise.py)
as one call each rather than 3-8 small torch ops (it is the default only where a C compiler
builds them). `triton` on the CPU runs the kernels under the Triton interpreter (start the
process with TRITON_INTERPRET=1).
Every op has both: paged attention (attention/dispatch.py) runs the split-KV decode kernel
and the varlen extend kernel on `triton`; the GEMM over a packed q8 / q4 weight
(quant/triton_gemm.py) dequantizes in registers.
"""

from __future__ import annotations

import torch

from cadenza.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from cadenza.kernels.attention.dispatch import paged_attention
from cadenza.kernels.backend import backend, default_backend, runs_native
from cadenza.kernels.cpu.elementwise import fused_add_rms_norm_cpu, rotary_cpu, silu_and_mul_cpu
from cadenza.kernels.kv_write import write_kv_ref, write_kv_triton
from cadenza.kernels.norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref
from cadenza.kernels.quant.triton_gemm import packed_matmul_ref, packed_matmul_triton
from cadenza.kernels.quant.weight import PackedWeight
from cadenza.kernels.rotary import rotary_ref, rotary_triton

__all__ = [
    "backend", "default_backend", "fused_add_rms_norm", "packed_matmul", "paged_attention", "rms_norm", "rotary",
    "silu_and_mul", "write_kv",
]  # fmt: skip


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if backend(x.device) == "triton":
        return fused_add_rms_norm_triton(x, None, weight, eps)[0]
    if runs_native(x):
        return fused_add_rms_norm_cpu(x, None, weight, eps)[0]
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend(x.device) == "triton":
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if runs_native(x):
        return fused_add_rms_norm_cpu(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if backend(q.device) == "triton":
        return rotary_triton(q, k, cos_sin)
    if runs_native(q):
        return rotary_cpu(q, k, cos_sin)
    return rotary_ref(q, k, cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if backend(x.device) == "triton":
        return silu_and_mul_triton(x)
    if runs_native(x):
        return silu_and_mul_cpu(x)
    return silu_and_mul_ref(x)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if backend(key.device) == "triton":
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def packed_matmul(x: torch.Tensor, w: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W.T (+ bias) for a q8 / q4 PackedWeight, in x's dtype."""
    if backend(x.device) == "triton":
        return packed_matmul_triton(x, w, bias)
    return packed_matmul_ref(x, w, bias)
