"""One function per hot op; the model calls only these.

Each dispatches to the backend in CADENZA_KERNELS (`torch`, `cpu` or `triton`), read per call
so a test can switch it; the default is triton on CUDA and cpu on the CPU. `torch` is the pure
torch reference; `cpu` runs fp32 CPU tensors through the C kernels of cpu_native instead: decode
attention (one-query rows) reading K/V in place rather than gathering a padded copy, and the
norm, rotary and SiLU ops as one call each rather than 3-8 small torch ops (it is the default
only where a C compiler builds them). `triton` on the CPU runs the kernels under the Triton
interpreter (start the process with TRITON_INTERPRET=1).
Every op has both: paged attention runs the split-KV decode kernel and the varlen extend
kernel on `triton`; the weight-only quantized GEMMs (W8A16, W4A16) dequantize in registers.
"""

from __future__ import annotations

import functools
import os

import torch

from cadenza.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from cadenza.kernels.attention import paged_attention_ref
from cadenza.kernels.cpu_native import (
    decode_attention_available,
    elementwise_available,
    fused_add_rms_norm_cpu,
    paged_decode_attention_cpu,
    rotary_cpu,
    silu_and_mul_cpu,
)
from cadenza.kernels.kv_write import write_kv_ref, write_kv_triton
from cadenza.kernels.metadata import AttentionMetadata
from cadenza.kernels.norm import fused_add_rms_norm_ref, fused_add_rms_norm_triton, rms_norm_ref
from cadenza.kernels.paged_attention import paged_attention_triton
from cadenza.kernels.quant_gemm import (
    w4a16_matmul_ref,
    w4a16_matmul_triton,
    w8a16_matmul_ref,
    w8a16_matmul_triton,
)
from cadenza.kernels.rotary import rotary_ref, rotary_triton

_BACKENDS = ("torch", "cpu", "triton")


@functools.cache
def default_backend() -> str:
    """triton on CUDA; on the CPU the C decode attention when this host can build it."""
    if torch.cuda.is_available():
        return "triton"
    return "cpu" if decode_attention_available() and elementwise_available() else "torch"


def backend() -> str:
    """The kernel backend in force; a clear error for an unknown one."""
    name = os.environ.get("CADENZA_KERNELS") or default_backend()
    if name not in _BACKENDS:
        raise ValueError(f"CADENZA_KERNELS={name!r} is not available; choose one of {_BACKENDS}")
    return name


def _native(x: torch.Tensor) -> bool:
    """Whether the `cpu` backend's C kernels take this tensor (fp32 on the CPU)."""
    return backend() == "cpu" and x.dtype == torch.float32 and x.device.type == "cpu"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if backend() == "triton":
        return fused_add_rms_norm_triton(x, None, weight, eps)[0]
    if _native(x):
        return fused_add_rms_norm_cpu(x, None, weight, eps)[0]
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend() == "triton":
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    if _native(x):
        return fused_add_rms_norm_cpu(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if backend() == "triton":
        return rotary_triton(q, k, cos_sin)
    if _native(q):
        return rotary_cpu(q, k, cos_sin)
    return rotary_ref(q, k, cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if backend() == "triton":
        return silu_and_mul_triton(x)
    if _native(x):
        return silu_and_mul_cpu(x)
    return silu_and_mul_ref(x)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    if backend() == "triton":
        write_kv_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    if backend() == "triton":
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    if _native(q):
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, decode=paged_decode_attention_cpu)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if backend() == "triton":
        return w8a16_matmul_triton(x, qweight, scales)
    return w8a16_matmul_ref(x, qweight, scales)


def w4a16_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    if backend() == "triton":
        return w4a16_matmul_triton(x, packed, scales, zeros, group_size)
    return w4a16_matmul_ref(x, packed, scales, zeros, group_size)
