"""paged_attention: one varlen batch's attention over the paged KV cache, on the backend in force.

`triton` runs the split-KV decode kernel and the varlen extend kernel (triton_paged.py);
`cpu` runs the torch reference's plan with its one-query rows and its long extends/prefills
in C (cpu.py), reading K/V in place rather than gathering a copy; `torch` is the reference
throughout.
"""

from __future__ import annotations

from functools import partial

import torch

from cadenza.kernels.attention.cpu import paged_decode_attention_cpu, paged_prefill_attention_cpu, reads_cache
from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.attention.reference import paged_attention_ref
from cadenza.kernels.attention.triton_paged import paged_attention_triton
from cadenza.kernels.backend import backend, runs_native

_PREFILL_BF16 = partial(paged_prefill_attention_cpu, bf16=True)  # built once, not per layer and step


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    bf16_products: bool = False,
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D] for every token of the batch (contract: paged_attention_ref).
    bf16_products: the C kernel's long extends and prefills multiply bf16-rounded inputs
    (the engine's cpu_gemm_dtype bf16); decode rows and the other backends are unaffected."""
    if backend(q.device) == "triton":
        return paged_attention_triton(q, k_cache, v_cache, meta, scale)
    if runs_native(q) and reads_cache(k_cache):
        long = _PREFILL_BF16 if bf16_products else paged_prefill_attention_cpu
        return paged_attention_ref(q, k_cache, v_cache, meta, scale, decode=paged_decode_attention_cpu, long=long)
    return paged_attention_ref(q, k_cache, v_cache, meta, scale)
