"""What every Triton launcher shares. On a machine without CUDA the kernels run under the
Triton interpreter, which must be switched on (TRITON_INTERPRET=1) before any kernel module
is imported: `triton.jit` decides interpreted vs compiled when it decorates."""

from __future__ import annotations

import functools

import torch
import triton


def block_for(n: int) -> int:
    """The power-of-two tile that covers n elements of a row."""
    return triton.next_power_of_2(max(n, 1))


def dot_tile(n: int) -> int:
    """A power-of-two tile of at least 16: the smallest operand side tl.dot accepts on a GPU."""
    return max(16, block_for(n))


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input precision: fp32 operands would silently drop to TF32 on a GPU, far below
    the fp32 reference's own error, so ask for full precision; fp16/bf16 ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors to fill (1 off CUDA: the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _sm_count(index: int) -> int:  # asked once per layer per step: cache the property lookup
    return torch.cuda.get_device_properties(index).multi_processor_count
