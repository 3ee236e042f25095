"""Which way round the BLAS multiplies a few dozen rows of x by a weight tile, measured once.

y = x @ W.T can also be computed as (W @ x.T).T: the same products, summed in the same
K order per output, by another BLAS kernel. Below 64 rows MKL's kernel for the first form is
slow: on a 2-core Ice Lake Xeon (AVX-512, fp32) 32 rows x a 3072 x 576 tile ran at 45-60
GFLOP/s against 100-175 for the second, while from 64 rows the first was the faster (MKL
switches kernels there). Which form wins is a fact of the BLAS build and the CPU, so it is
measured on first use, per dtype and power-of-two row bucket, and never assumed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

# Above this many rows (prefill chunks) the BLAS's plain form is assumed efficient.
MAX_CALIBRATED_ROWS = 128
# The tile shape the race runs on: a SmolLM2-sized MLP projection.
_RACE_SHAPE = (1536, 576)
_RACE_REPS = 3


def transposed_wins(rows: int, dtype: torch.dtype) -> bool:
    """Whether (W @ x.T).T beat x @ W.T for this many rows of x in dtype on this machine."""
    if rows > MAX_CALIBRATED_ROWS:
        return False
    return _race(1 << (rows - 1).bit_length(), dtype)


@functools.cache
def _race(rows: int, dtype: torch.dtype) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, _RACE_SHAPE[1], generator=g).to(dtype)
    w = torch.randn(*_RACE_SHAPE, generator=g).to(dtype)
    plain = _best_seconds(lambda: x @ w.T)
    swapped = _best_seconds(lambda: (w @ x.T).T.contiguous())
    return swapped < plain * 0.9  # a clear win only: both are correct


def _best_seconds(f: Callable[[], object]) -> float:
    f()  # warm: the BLAS's first call sets up its threads and buffers
    best = float("inf")
    for _ in range(_RACE_REPS):
        start = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - start)
    return best
