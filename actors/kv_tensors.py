"""The KV cache's tensors: one (K, V) pair per layer of this stage, blocks of block_size slots,
this rank's KV heads. The block accounting lives in kv_cache_manager.py; these are the bytes."""

from __future__ import annotations

import math
import mmap

import torch

from cadenza.models.llama import LlamaForCausalLM


def allocate_kv_cache(
    model: LlamaForCausalLM, num_blocks: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed, so never-written slots that a padded gather reads are finite (0 * NaN would leak),
    and on the CPU resident only as blocks are first written (see zeroed_kv_tensor)."""
    dtype, device = model.weight_format.cache_dtype(model.norm.dtype), model.norm.device
    caches = []
    for layer in model.layers:  # this pipeline stage's layers, this rank's KV heads
        shape = (num_blocks, block_size, layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
        caches.append((zeroed_kv_tensor(shape, dtype, device), zeroed_kv_tensor(shape, dtype, device)))
    return caches


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU it sits on an anonymous mapping of its own: the kernel hands
    out zero pages and commits each only when it is first written, so a 2 GiB pool costs
    resident memory for the blocks in use, not for all of it. torch.zeros would write (and
    commit) every page up front; torch.empty is lazy only when malloc happens to mmap the
    request, and may otherwise return recycled heap holding NaNs, which the torch reference's
    padded decode would multiply by probability 0 into NaN. A GPU commits memory on
    allocation either way, so there it is plain torch.zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    # The tensor holds a reference to the mapping, which is unmapped with the last tensor.
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype, count=count).view(shape)
