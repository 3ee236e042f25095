"""The packed-weight kernels in C (csrc/packed_linear.c): matmul, dequantize and row gather
straight from a PackedWeight's storage."""

from __future__ import annotations

import ctypes

import torch

from cadenza.kernels.cpu.bindings import (
    PACKED_DEQUANTIZE,
    PACKED_DEQUANTIZE_BF16,
    PACKED_FUSED_ROWS,
    PACKED_GATHER_ROWS,
    PACKED_LINEAR,
    ROUND_ACTIVATIONS,
)
from cadenza.kernels.quant.weight import KIND_CODES, PackedWeight


class CPackedWeight(ctypes.Structure):
    """csrc/cadenza_kernels.h's struct packed_weight."""

    _fields_ = [
        ("kind", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("round_x", ctypes.c_int64),
        ("data", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("mins", ctypes.c_void_p),
    ]


class BoundWeight:
    """A PackedWeight with its C descriptor; holding the weight keeps the pointers valid.
    round_x: q4 / q8 read x rounded to int8 per block of 32 (csrc/packed_linear.c)."""

    def __init__(self, weight: PackedWeight, round_x: bool = False) -> None:
        if weight.device.type != "cpu" or not all(t.is_contiguous() for t in weight.tensors()):
            raise ValueError("the C packed kernels take contiguous CPU storage")
        self.weight = weight

        def address(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        self.c = CPackedWeight(
            KIND_CODES[weight.kind], weight.rows, weight.cols, weight.group, int(round_x),
            address(weight.data), address(weight.scales), address(weight.mins),
        )  # fmt: skip
        self.address = ctypes.addressof(self.c)
        # How many rows of x the C kernel's fused paths take in one pass, asked once (at load).
        self.fused_rows = int(PACKED_FUSED_ROWS(w=self.address)) if PACKED_FUSED_ROWS.available() else 0


def packed_available() -> bool:
    return PACKED_LINEAR.available()


def packed_linear(bound: BoundWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, cols] fp32 -> [M, rows]; W's storage is read once whatever M is."""
    x = x.contiguous()
    y = torch.empty(x.shape[0], bound.weight.rows, dtype=torch.float32)
    PACKED_LINEAR(w=bound.address, x=x, bias=bias, y=y, m_dim=x.shape[0], num_threads=torch.get_num_threads())
    return y


def round_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] rounded to int8 per block of 32, as the q4 / q8 kernels read it."""
    x = x.contiguous()
    out = torch.empty_like(x)
    ROUND_ACTIVATIONS(x=x, rows=x.shape[0], cols=x.shape[1], out=out)
    return out


DEQUANTIZE_TO = {torch.float32: PACKED_DEQUANTIZE, torch.bfloat16: PACKED_DEQUANTIZE_BF16}


def packed_dequantize(bound: BoundWeight, start: int, end: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows [start, end) as [end - start, cols] in dtype (one of DEQUANTIZE_TO): bf16 is the
    fp32 decode rounded as torch's .to(torch.bfloat16) rounds it, written once."""
    out = torch.empty(end - start, bound.weight.cols, dtype=dtype)
    DEQUANTIZE_TO[dtype](w=bound.address, start=start, end=end, out=out, num_threads=torch.get_num_threads())
    return out


def packed_gather(bound: BoundWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` as fp32 [len(ids), cols]: embedding lookups from packed storage."""
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), bound.weight.cols, dtype=torch.float32)
    PACKED_GATHER_ROWS(w=bound.address, ids=ids, n_ids=ids.numel(), out=out, num_threads=torch.get_num_threads())
    return out
