"""Paged attention over a varlen batch on the Triton kernels (contract: paged_attention_ref).

Decodes (the first meta.num_decodes requests, one query token each) go through the split-KV
decode kernel; every other request (chunked prefill, prefix-cache extend, speculative
verification with k+1 tokens) goes through one launch of the extend kernel.
"""

from __future__ import annotations

import torch

from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.attention.triton_decode import paged_decode_attention_triton
from cadenza.kernels.attention.triton_extend import extend_attention_triton


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; both kernels write into one output tensor."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd, qsl = meta.num_decodes, meta.query_start_loc
    if nd:
        paged_decode_attention_triton(
            q[:nd],
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens_tensor,
            scale,
            max_seq_len=max(meta.seq_lens[:nd]),
            out=out[:nd],
        )
    if meta.num_reqs > nd:
        if meta.query_start_loc_tensor is None:
            meta.query_start_loc_tensor = torch.tensor(qsl, dtype=torch.int32, device=q.device)
        extend_attention_triton(
            q,
            k_cache,
            v_cache,
            out,
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.query_start_loc_tensor,
            first_req=nd,
            num_reqs=meta.num_reqs - nd,
            max_q_len=max(qsl[i + 1] - qsl[i] for i in range(nd, meta.num_reqs)),
            scale=scale,
        )
    return out
