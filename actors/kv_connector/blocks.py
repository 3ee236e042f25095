"""A worker's KV blocks as one array per cache set (the model's; a draft model's beside it on
the driver) and back: every layer of this stage, K and V, the given blocks, this rank's heads:
[layers, 2, blocks, block_size, kv_heads, head_dim]. numpy, so Ray's object store keeps the
arrays' bytes out of band (pickle 5 buffers) and a reader on the same node maps them without a
copy (bf16 travels as its int16 bits: numpy has no bf16)."""

from __future__ import annotations

import warnings

import numpy as np
import torch

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def gather_blocks(caches: KVCaches, block_ids: list[int]) -> np.ndarray:
    index = torch.tensor(block_ids, dtype=torch.long, device=caches[0][0].device)
    stacked = torch.stack([torch.stack((k.index_select(0, index), v.index_select(0, index))) for k, v in caches])
    if stacked.dtype == torch.bfloat16:
        stacked = stacked.view(torch.int16)
    return stacked.cpu().numpy()


def scatter_blocks(caches: KVCaches, block_ids: list[int], data: np.ndarray) -> None:
    """Write `data` (gather_blocks' shape, from a worker of the same shard) into block_ids."""
    with warnings.catch_warnings():  # a store-mapped array is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(data)
    dtype, device = caches[0][0].dtype, caches[0][0].device
    values = values.view(dtype) if dtype == torch.bfloat16 else values
    if values.shape[0] != len(caches) or values.shape[3:] != caches[0][0].shape[1:]:
        raise ValueError(f"KV blocks of shape {tuple(values.shape)} do not fit this worker's cache")
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    for layer, (k, v) in enumerate(caches):
        k.index_copy_(0, index, values[layer, 0].to(device=device, dtype=dtype))
        v.index_copy_(0, index, values[layer, 1].to(device=device, dtype=dtype))
