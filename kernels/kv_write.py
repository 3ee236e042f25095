"""KV write: scatter this step's K/V rows into their paged cache slots."""

from __future__ import annotations

import torch


def write_kv_ref(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """key/value [T, K, D] -> caches [num_blocks, block_size, K, D] at flat slots `slot_mapping`,
    rounded to the caches' dtype where it is narrower (kv_cache_dtype)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(v_cache.dtype))
