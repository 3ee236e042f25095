"""The numerical criterion every kernel test uses, and the devices/dtypes they run on."""

from __future__ import annotations

import torch

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if torch.cuda.is_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def within_2x(kernel: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> None:
    """The kernel's max error against the fp32 result is at most twice the torch reference's
    own in the same dtype, plus a floor for exact fp32 ties."""
    ref_error = (ref.float() - exact).abs().max().item()
    kernel_error = (kernel.float() - exact).abs().max().item()
    assert kernel_error <= 2 * ref_error + 1e-5 * max(exact.abs().max().item(), 1.0), (kernel_error, ref_error)
