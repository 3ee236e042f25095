"""Packing a loaded dense weight into the weight format (kernels/quant): what prepare_kernels
does to each projection and to the embedding before choosing their kernels.

- On-load int8: every projection, the LM head and the embedding, int8 per output channel.
- On-load int4: the projections int4 in groups; the LM head and the embedding int8. The
  documented choice: the head decides every token, and on SmolLM2 its int4 version cost
  several points of perplexity for 21% of the weights (see docs/formats.md).
- bf16 / f16 on the CPU: the dense weights stored as those rows (the kernels compute in fp32).
- fp32 on the CPU, or any dense dtype on CUDA: left dense (their own fast paths).
"""

from __future__ import annotations

import torch

from cadenza.kernels.quant.quantize import quantize, to_dense_kind
from cadenza.kernels.quant.weight import PackedWeight
from cadenza.weight_format import WeightFormat


def packs(fmt: WeightFormat, device: torch.device) -> bool:
    """Whether weights on `device` are packed in this format (else they stay dense)."""
    return fmt.quantization is not None or (device.type == "cpu" and fmt.dense_kind != "f32")


def pack_weight(rows: torch.Tensor, fmt: WeightFormat, is_head: bool) -> PackedWeight | None:
    """W [out, in] in the format, or None where it stays a dense parameter."""
    if not packs(fmt, rows.device):
        return None
    if fmt.quantization is None:
        return to_dense_kind(rows, fmt.dense_kind)
    return quantize(rows, "int8" if is_head else fmt.quantization, fmt.group_size)


def packs_embedding(fmt: WeightFormat, table: torch.Tensor) -> bool:
    return table.numel() > 1 and packs(fmt, table.device)


def pack_linear(linear: torch.nn.Module, fmt: WeightFormat, is_head: bool) -> None:
    """Pack one Linear's dense weight_t in place (already-packed and placeholder ones stay)."""
    if linear.packed is not None or linear.weight_t.numel() <= 1:
        return
    packed = pack_weight(linear.weight_t.detach().t(), fmt, is_head)
    if packed is not None:
        linear.set_packed([packed])
