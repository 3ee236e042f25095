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
    """The blocks' K and V of every layer, copied once into one array (on a GPU: once on the
    device, then to host)."""
    k0 = caches[0][0]
    index = torch.tensor(block_ids, dtype=torch.long, device=k0.device)
    out = torch.empty((len(caches), 2, len(block_ids), *k0.shape[1:]), dtype=k0.dtype, device=k0.device)
    for layer, (k, v) in enumerate(caches):
        torch.index_select(k, 0, index, out=out[layer, 0])
        torch.index_select(v, 0, index, out=out[layer, 1])
    return (out.view(torch.int16) if out.dtype == torch.bfloat16 else out).cpu().numpy()


def scatter_blocks(caches: KVCaches, block_ids: list[int], data: np.ndarray, positions: list[int]) -> int:
    """Write blocks `positions` of `data` (gather_blocks' array, from a worker of the same
    shard) into block_ids, layer by layer (no whole-array copy first); returns the bytes."""
    with warnings.catch_warnings():  # a store-mapped array is read-only; it is only read here
        warnings.simplefilter("ignore", UserWarning)
        values = torch.from_numpy(data)
    dtype, device = caches[0][0].dtype, caches[0][0].device
    values = values.view(dtype) if dtype == torch.bfloat16 and values.dtype == torch.int16 else values
    if values.shape[0] != len(caches) or values.shape[3:] != caches[0][0].shape[1:] or values.dtype != dtype:
        raise ValueError(f"KV blocks of shape {tuple(values.shape)} ({values.dtype}) do not fit this worker's cache")
    index = torch.tensor(block_ids, dtype=torch.long, device=device)
    picked = None if positions == list(range(values.shape[2])) else torch.tensor(positions, dtype=torch.long)
    for layer, (k, v) in enumerate(caches):
        for cache, part in ((k, values[layer, 0]), (v, values[layer, 1])):
            part = part if picked is None else part.index_select(0, picked)
            cache.index_copy_(0, index, part.to(device))
    return len(positions) * values[:, :, 0].numel() * values.element_size()
