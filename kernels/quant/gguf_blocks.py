"""GGUF tensors' bytes as PackedWeights: Q8_0, Q4_0 and Q4_1 blocks split into codes and
scales (lossless: the same codes, the fp16 scales as stored or widened to fp32), Q4_K and
Q6_K kept as their super-blocks, F32 / F16 / BF16 as rows of that dtype.

Blocks run along a row (the input features), so a row's bytes are its own blocks: rows can
be permuted, sliced and fused on the raw bytes."""

from __future__ import annotations

import numpy as np
import torch

from cadenza.kernels.quant.weight import SUPERBLOCK, SUPERBLOCK_BYTES, PackedWeight

# GGML type names that stay packed, and the bytes of one block of 32 weights for the split ones.
KEPT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
_DENSE = {"F32": ("f32", torch.float32), "F16": ("f16", torch.float16), "BF16": ("bf16", torch.bfloat16)}


def packed_from_gguf(type_name: str, raw: np.ndarray, rows: int, cols: int) -> PackedWeight:
    """One tensor's stored bytes (or elements, for the dense types), [rows, ...] row-major."""
    if type_name in _DENSE:
        kind, dtype = _DENSE[type_name]
        data = torch.from_numpy(np.array(raw, copy=True)).view(torch.uint8).view(dtype).view(rows, cols)
        return PackedWeight(kind, rows, cols, data)
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(torch.uint8).reshape(rows, -1)
    if type_name in ("Q4_K", "Q6_K"):
        kind = type_name.lower()
        if blocks.shape[1] != cols // SUPERBLOCK * SUPERBLOCK_BYTES[kind]:
            raise ValueError(f"{type_name} tensor of {cols} columns has {blocks.shape[1]} bytes a row")
        return PackedWeight(kind, rows, cols, blocks, group=SUPERBLOCK)
    if type_name not in _BLOCK_BYTES:
        raise ValueError(f"GGUF type {type_name} is not kept packed")
    return _split_blocks(type_name, blocks.reshape(rows, cols // 32, _BLOCK_BYTES[type_name]), rows, cols)


def _split_blocks(type_name: str, blocks: torch.Tensor, rows: int, cols: int) -> PackedWeight:
    def fp16(start: int) -> torch.Tensor:
        return blocks[:, :, start : start + 2].contiguous().view(torch.float16).view(rows, -1)

    if type_name == "Q8_0":
        codes = blocks[:, :, 2:].contiguous().view(torch.int8).view(rows, cols)
        return PackedWeight("q8", rows, cols, codes, group=32, scales=fp16(0).float())
    offset = 4 if type_name == "Q4_1" else 2
    codes = blocks[:, :, offset:].reshape(rows, cols // 2).contiguous()
    mins = fp16(2) if type_name == "Q4_1" else None
    return PackedWeight("q4", rows, cols, codes, group=32, scales=fp16(0), mins=mins)
