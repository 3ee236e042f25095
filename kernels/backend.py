"""Which kernels run: CADENZA_KERNELS (`torch`, `cpu` or `triton`), else the device's default.

Read when something is bound (a model's Kernels bundle in ops.bind_kernels, each LinearMethod
as it is built), never per op: a choice made at load time holds for the model's life, and a
test that wants another backend sets the variable before it builds the model.
"""

from __future__ import annotations

import functools
import os

import torch

from cadenza.kernels.attention.cpu import decode_attention_available
from cadenza.kernels.cpu.elementwise import elementwise_available

BACKENDS = ("torch", "cpu", "triton")


@functools.cache
def host_backend() -> str:
    """The CPU's default: the C kernels when this host can build them, else torch."""
    return "cpu" if decode_attention_available() and elementwise_available() else "torch"


def default_backend(device: torch.device | None = None) -> str:
    """triton for tensors on CUDA, host_backend() for tensors on the CPU. Without a device:
    where torch would put them (CUDA when visible). A model placed on the CPU of a GPU host
    gets the CPU kernels: the backend follows the tensors, not the machine."""
    on_cuda = device.type == "cuda" if device is not None else torch.cuda.is_available()
    return "triton" if on_cuda else host_backend()


def backend(device: torch.device | None = None) -> str:
    """The kernel backend for tensors on `device`: CADENZA_KERNELS when set, else
    default_backend(device); a clear error for an unknown one. Call it where a choice is
    bound (load time), not on an op's path."""
    name = os.environ.get("CADENZA_KERNELS") or default_backend(device)
    if name not in BACKENDS:
        raise ValueError(f"CADENZA_KERNELS={name!r} is not available; choose one of {BACKENDS}")
    return name
