"""What every Triton launcher shares. On a machine without CUDA the kernels run under the
Triton interpreter, which must be switched on (TRITON_INTERPRET=1) before any kernel module
is imported: `triton.jit` decides interpreted vs compiled when it decorates."""

from __future__ import annotations

import triton


def block_for(n: int) -> int:
    """The power-of-two tile that covers n elements of a row."""
    return triton.next_power_of_2(max(n, 1))
