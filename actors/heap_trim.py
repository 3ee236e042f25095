"""Give freed heap pages back to the OS (glibc's malloc_trim) at the moments a process has just
dropped a lot of memory: after the model is loaded and its kernels prepared (the loader's
dense and packed copies of weights, freed), and when an engine goes idle after work.

Why: glibc keeps freed chunks inside its arenas (one per thread that allocated, 64 MB each)
and returns only the top of each; load-time buffers freed in the middle stay resident. Measured
on SmolLM2 (Q4_1) in one process: 443 MB RSS after load, 385 MB after a trim. A no-op where
the C library is not glibc."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to call
        return None


def trim_heap() -> bool:
    """Release free heap pages in every arena; True where the C library can (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
