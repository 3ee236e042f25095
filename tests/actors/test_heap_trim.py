"""trim_heap gives freed pages in the middle of the heap back (glibc keeps them otherwise)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from cadenza.actors.heap_trim import trim_heap


def _rss_anon_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))


def test_freed_heap_pages_go_back_to_the_os() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "malloc_trim"):
        pytest.skip("not glibc: trim_heap is a no-op here")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    chunks = [libc.malloc(4096) for _ in range(40_000)]  # ~160 MB below the mmap threshold
    for chunk in chunks:
        ctypes.memset(chunk, 1, 4096)
    for chunk in chunks[:-1]:  # the last one pins the heap's top, so free() cannot trim it
        libc.free(chunk)
    held = _rss_anon_kb()
    assert trim_heap()
    assert _rss_anon_kb() < held - 100_000  # most of the 160 MB came back
    libc.free(chunks[-1])
