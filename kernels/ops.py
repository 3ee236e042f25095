"""The hot ops between the projections, bound once: a frozen Kernels bundle per backend.

bind_kernels(device) reads the backend (CADENZA_KERNELS, else the device's default; see
backend.py) once, when a model is prepared, and returns that backend's bundle of callables;
the model holds it and its layers call through it, so no op reads the environment or walks
an if-chain per call, layer and step. `torch` is the pure torch reference; `cpu` runs fp32
CPU tensors through the C kernels instead: decode attention (one-query rows, attention/cpu.py)
reading K/V in place rather than gathering a padded copy, and the norm, rotary and SiLU ops
(cpu/elementwise.py) as one call each rather than 3-8 small torch ops (it is the default only
where a C compiler builds them). `triton` on the CPU runs the kernels under the Triton
interpreter (start the process with TRITON_INTERPRET=1). Every op has both: paged attention
(attention/dispatch.py) runs the split-KV decode kernel and the varlen extend kernel on
`triton`; the GEMM over a packed q8 / q4 weight (quant/triton_gemm.py) dequantizes in registers.
Projections bind their own kernels the same way, in their LinearMethod (kernels/linear).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from cadenza.kernels.activation import silu_and_mul_ref
from cadenza.kernels.attention.dispatch import PAGED_ATTENTION, PagedAttention
from cadenza.kernels.backend import backend, default_backend
from cadenza.kernels.cpu.elementwise import fused_add_rms_norm_cpu, rotary_cpu, silu_and_mul_cpu
from cadenza.kernels.kv_write import write_kv_ref
from cadenza.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from cadenza.kernels.quant.dequantize import packed_matmul_ref
from cadenza.kernels.quant.weight import PackedWeight
from cadenza.kernels.rotary import rotary_ref

__all__ = ["BUNDLES", "Kernels", "backend", "bind_kernels", "default_backend"]

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class Kernels:
    """One backend's implementation of every hot op; contracts are the `_ref` functions'."""

    backend: str
    rms_norm: Callable[[Tensor, Tensor, float], Tensor]  # (x, weight, eps)
    # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
    fused_add_rms_norm: Callable[[Tensor, Tensor, Tensor, float], tuple[Tensor, Tensor]]
    rotary: Callable[[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]  # (q, k, cos_sin)
    silu_and_mul: Callable[[Tensor], Tensor]
    write_kv: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], None]  # (k, v, k_cache, v_cache, slots)
    paged_attention: PagedAttention
    packed_matmul: Callable[[Tensor, PackedWeight, Tensor | None], Tensor]  # (x, w, bias), q8 / q4 W


def bind_kernels(device: torch.device) -> Kernels:
    """The bundle for a model on `device`: the one place a model's ops read the backend."""
    name = backend(device)
    if name == "cpu" and device.type != "cpu":
        return BUNDLES["torch"]  # the C kernels read host memory: CUDA tensors take the reference
    return BUNDLES[name]


# The C kernels read fp32 CPU tensors. A bf16 model on the `cpu` backend still meets fp32
# ones (a packed projection returns fp32), so the cpu bundle checks each tensor: a guard on the
# data, not a choice of backend.
def _native(x: Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu"


def _rms_norm_cpu(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return fused_add_rms_norm_cpu(x, None, weight, eps)[0] if _native(x) else rms_norm_ref(x, weight, eps)


def _fused_add_rms_norm_cpu(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    if _native(x):
        return fused_add_rms_norm_cpu(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def _rotary_cpu(q: Tensor, k: Tensor, cos_sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotary_cpu(q, k, cos_sin) if _native(q) else rotary_ref(q, k, cos_sin)


def _silu_and_mul_cpu(x: Tensor) -> Tensor:
    return silu_and_mul_cpu(x) if _native(x) else silu_and_mul_ref(x)


def _triton_bundle() -> Kernels:
    """Triton's bundle, imported only when asked for: a CPU host never imports Triton, so one
    without a Triton wheel serves on the `cpu` / `torch` bundles."""
    try:
        from cadenza.kernels.quant.triton_gemm import packed_matmul_triton
        from cadenza.kernels.triton_elementwise import (
            fused_add_rms_norm_triton,
            rotary_triton,
            silu_and_mul_triton,
            write_kv_triton,
        )
    except ImportError as e:
        raise RuntimeError(f"CADENZA_KERNELS=triton needs Triton, which does not import here: {e}") from None

    def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return fused_add_rms_norm_triton(x, None, weight, eps)[0]

    return Kernels(
        "triton", rms_norm, fused_add_rms_norm_triton, rotary_triton, silu_and_mul_triton, write_kv_triton,
        PAGED_ATTENTION["triton"], packed_matmul_triton,
    )  # fmt: skip


class _Bundles(dict):
    """backend name -> Kernels; the triton bundle is built on first use (_triton_bundle)."""

    def __missing__(self, name: str) -> Kernels:
        if name != "triton":
            raise KeyError(name)
        self[name] = bundle = _triton_bundle()
        return bundle


BUNDLES: dict[str, Kernels] = _Bundles(
    torch=Kernels(
        "torch", rms_norm_ref, fused_add_rms_norm_ref, rotary_ref, silu_and_mul_ref, write_kv_ref,
        PAGED_ATTENTION["torch"], packed_matmul_ref,
    ),
    cpu=Kernels(
        "cpu", _rms_norm_cpu, _fused_add_rms_norm_cpu, _rotary_cpu, _silu_and_mul_cpu, write_kv_ref,
        PAGED_ATTENTION["cpu"], packed_matmul_ref,
    ),
)  # fmt: skip
