"""Checkpoints that store a layer's projections fused (Phi-3: `qkv_proj`, `gate_up_proj`), read
as the separate q/k/v and gate/up tensors every other family stores. Splitting by name at
the source keeps one path after it: the loader's offsets into our own fused projections, the
TP rank slicer and the completeness check all see the names they know."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cadenza.kernels.quant.weight import PackedWeight
from cadenza.models.config import ModelConfig

Loaded = torch.Tensor | PackedWeight

FUSED_CHECKPOINT_ARCHITECTURES = {"Phi3ForCausalLM"}


def split_fused(tensors: Iterator[tuple[str, Loaded]], cfg: ModelConfig) -> Iterator[tuple[str, Loaded]]:
    """The checkpoint's tensors with every fused projection split into its parts (views; a
    GGUF's packed rows split as stored)."""
    parts = {
        "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), (cfg.q_size, cfg.kv_size, cfg.kv_size)),
        "mlp.gate_up_proj": (("gate_proj", "up_proj"), (cfg.intermediate_size, cfg.intermediate_size)),
    }
    for name, tensor in tensors:
        head, _, kind = name.rpartition(".")
        fused = next((f for f in parts if head.endswith("." + f)), None)
        if fused is None:
            yield name, tensor
            continue
        names, sizes = parts[fused]
        rows = tensor.rows if isinstance(tensor, PackedWeight) else tensor.shape[0]
        if rows != sum(sizes):
            raise ValueError(f"{name}: {rows} rows, expected {sum(sizes)} ({' + '.join(map(str, sizes))})")
        stem = head[: -len(fused.rpartition(".")[2])]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        packed = isinstance(tensor, PackedWeight)
        for part, start, size in zip(names, starts, sizes, strict=True):
            end = start + size
            yield f"{stem}{part}.{kind}", tensor.row_view(start, end) if packed else tensor[start:end]
