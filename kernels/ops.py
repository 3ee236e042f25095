"""One function per hot op; the model calls only these.

Each dispatches to a backend chosen once from CADENZA_KERNELS (`torch` or `triton`); the
default is torch on the CPU. Triton kernels land beside their references in this package.
"""

from __future__ import annotations

import os

import torch
from cadenza.kernels.activation import silu_and_mul_ref
from cadenza.kernels.attention import paged_attention_ref
from cadenza.kernels.kv_write import write_kv_ref
from cadenza.kernels.metadata import AttentionMetadata
from cadenza.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from cadenza.kernels.rotary import rotary_ref

_BACKENDS = ("torch",)


def backend() -> str:
    """The kernel backend in force; a clear error for one that does not exist yet."""
    name = os.environ.get("CADENZA_KERNELS", "torch")
    if name not in _BACKENDS:
        raise ValueError(f"CADENZA_KERNELS={name!r} is not available; choose one of {_BACKENDS}")
    return name


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def rotary(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_ref(q, k, cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(x)


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    write_kv_ref(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)
