"""Paged attention per backend: one varlen batch's attention over the paged KV cache.

PAGED_ATTENTION maps each backend to its implementation; a model's Kernels bundle
(kernels/ops.py) takes one of them when the model is prepared, so no call reads the backend.
`triton` runs the split-KV decode kernel and the varlen extend kernel (triton_paged.py);
`cpu` runs the torch reference's plan with its one-query rows and its long extends/prefills
in C (cpu.py), reading K/V in place rather than gathering a copy; `torch` is the reference
throughout. Contract of each: paged_attention_ref (q [T, H, D] -> [T, H, D]).
"""

from __future__ import annotations

from functools import cache, partial
from typing import Protocol

import torch

from cadenza.kernels.attention.cpu import paged_decode_attention_cpu, paged_prefill_attention_cpu, reads_cache
from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.attention.reference import paged_attention_ref

_PREFILL_BF16 = partial(paged_prefill_attention_cpu, bf16=True)  # built once, not per layer and step


class PagedAttention(Protocol):
    """bf16_products: the C kernel's long extends and prefills multiply bf16-rounded inputs
    (the engine's cpu_gemm_dtype bf16); decode rows and the other backends ignore it."""

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        bf16_products: bool = False,
    ) -> torch.Tensor: ...


def torch_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    bf16_products: bool = False,
) -> torch.Tensor:
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)


def cpu_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    bf16_products: bool = False,
) -> torch.Tensor:
    # A data guard, not a backend choice: the C kernels read fp32 queries over fp32 / fp16
    # caches; a bf16 model's (or a bf16 cache's) batch runs the reference.
    if q.dtype != torch.float32 or not reads_cache(k_cache):
        return paged_attention_ref(q, k_cache, v_cache, meta, scale)
    long = _PREFILL_BF16 if bf16_products else paged_prefill_attention_cpu
    return paged_attention_ref(q, k_cache, v_cache, meta, scale, decode=paged_decode_attention_cpu, long=long)


def triton_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    bf16_products: bool = False,
) -> torch.Tensor:
    return _triton_kernels()(q, k_cache, v_cache, meta, scale)


@cache
def _triton_kernels() -> PagedAttention:
    # Imported on first use: a CPU host never imports Triton (kernels/ops.py).
    from cadenza.kernels.attention.triton_paged import paged_attention_triton

    return paged_attention_triton


PAGED_ATTENTION: dict[str, PagedAttention] = {
    "torch": torch_paged_attention,
    "cpu": cpu_paged_attention,
    "triton": triton_paged_attention,
}
