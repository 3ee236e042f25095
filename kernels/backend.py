"""Which kernels run: CADENZA_KERNELS (`torch`, `cpu` or `triton`), read per call so a test can switch it."""

from __future__ import annotations

import functools
import os

import torch

from cadenza.kernels.attention.cpu import decode_attention_available
from cadenza.kernels.cpu.elementwise import elementwise_available

BACKENDS = ("torch", "cpu", "triton")


@functools.cache
def default_backend() -> str:
    """triton on CUDA; on the CPU the C decode attention when this host can build it."""
    if torch.cuda.is_available():
        return "triton"
    return "cpu" if decode_attention_available() and elementwise_available() else "torch"


def backend() -> str:
    """The kernel backend in force; a clear error for an unknown one."""
    name = os.environ.get("CADENZA_KERNELS") or default_backend()
    if name not in BACKENDS:
        raise ValueError(f"CADENZA_KERNELS={name!r} is not available; choose one of {BACKENDS}")
    return name


def runs_native(x: torch.Tensor) -> bool:
    """Whether the `cpu` backend's C kernels take this tensor (fp32 on the CPU)."""
    return backend() == "cpu" and x.dtype == torch.float32 and x.device.type == "cpu"
