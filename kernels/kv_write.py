"""KV write: scatter this step's K/V rows into their paged cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadenza.kernels.triton_common import block_for


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value [T, K, D] -> caches [num_blocks, block_size, K, D] at flat slots `slot_mapping`,
    rounded to the caches' dtype where it is narrower (kv_cache_dtype)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_h,
    row,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    offs = tl.arange(0, BLOCK)
    mask = offs < row
    head, d = offs // HEAD_DIM, offs % HEAD_DIM
    k = tl.load(k_ptr + token * stride_kt + head * stride_h + d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_h + d, mask=mask)
    tl.store(kc_ptr + slot * row + offs, k, mask=mask)
    tl.store(vc_ptr + slot * row + offs, v, mask=mask)


def write_kv_triton(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """One program per token copies its K and V rows (all KV heads) into the flat slot."""
    tokens, heads, dim = key.shape
    if key.stride(2) != 1 or value.stride(2) != 1 or key.stride(1) != value.stride(1):
        key, value = key.contiguous(), value.contiguous()
    _write_kv_kernel[(tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        key.stride(1),
        heads * dim,
        HEAD_DIM=dim,
        BLOCK=block_for(heads * dim),
    )
