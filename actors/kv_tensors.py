"""The KV cache's tensors: one (K, V) pair per layer of this stage, blocks of block_size slots,
this rank's KV heads. The block accounting lives in kv_cache_manager.py; these are the bytes."""

from __future__ import annotations

import math
import mmap

import torch

from cadenza.actors.kv_connector.shared_cache import allocate_shared
from cadenza.models.llama import LlamaForCausalLM


def allocate_kv_cache(
    model: LlamaForCausalLM, num_blocks: int, block_size: int, share_place: str | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed, so never-written slots that a padded gather reads are finite (0 * NaN would leak),
    and on the CPU resident only as blocks are first written (see zeroed_kv_tensor). With
    share_place (where this process is: runner_setup.kv_place), one allocation other engines
    there can open (kv_connector/shared_cache.py: the `ipc` KV transport)."""
    dtype, device = model.weight_format.cache_dtype(model.norm.dtype), model.norm.device
    attns = [layer.self_attn for layer in model.layers]  # this pipeline stage's layers, this rank's KV heads
    shapes = [(num_blocks, block_size, a.num_kv_heads, a.head_dim) for a in attns]
    if share_place is not None:
        if len(set(shapes)) != 1:
            raise ValueError("a shared KV cache needs every layer's KV heads to be of one shape")
        return allocate_shared((len(shapes), 2, *shapes[0]), dtype, device, share_place)
    return [(zeroed_kv_tensor(shape, dtype, device), zeroed_kv_tensor(shape, dtype, device)) for shape in shapes]


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
