"""The C kernels' signatures, argument by argument, and a checked call by keyword.

Each function csrc/cadenza_kernels.h exports has one CFunction here: the library holding it
(built from csrc/<library>.c by build.load), its name and its arguments as (name, ctypes type)
in the header's order, under the header's names (a test compares the two). A call names every
argument, `GEMV_ROWS(x=x, w=w, ...)`: a missing, extra or misspelt one raises TypeError
before C runs, where a positional list would silently shift the rest.

Pointer arguments take the tensor itself (or None, or a ctypes array), and the call takes its
address: the tensor stays referenced by the call's own arguments until C returns, so no
pointer outlives what it points at (as `t.contiguous().data_ptr()` inline would: the copy
may be freed before C reads it).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from enum import IntEnum

import torch

from cadenza.kernels.cpu.build import load

POINTER, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class CFunction:
    """One exported C function: where it lives and its named, typed arguments."""

    def __init__(self, library: str, name: str, args: tuple[tuple[str, type], ...], restype: type | None) -> None:
        self.library, self.name, self.args, self.restype = library, name, args, restype
        self.names = frozenset(arg for arg, _ in args)
        self._order = tuple(arg for arg, _ in args)
        self._pointers = tuple(i for i, (_, kind) in enumerate(args) if kind is POINTER)
        self._entry: Callable[..., object] | None = None  # bound on first call; a loaded library stays

    def available(self) -> bool:
        return load(self.library) is not None

    def __call__(self, **arguments: object) -> object:
        if arguments.keys() != self.names:
            raise TypeError(self._mismatch(arguments))
        entry = self._entry or self._bind()
        values = list(map(arguments.__getitem__, self._order))
        # Addresses go in a copy: `arguments` keeps every tensor alive until C returns.
        for i in self._pointers:
            if isinstance(values[i], torch.Tensor):
                values[i] = values[i].data_ptr()
        return entry(*values)

    def _bind(self) -> Callable[..., object]:
        lib = load(self.library)
        if lib is None:
            raise RuntimeError(f"the CPU kernel library {self.library!r} is not built (see the log for why)")
        entry = getattr(lib, self.name)
        # Declared once: ctypes then converts and range-checks every value as it calls.
        entry.argtypes, entry.restype = [kind for _, kind in self.args], self.restype
        self._entry = entry
        return entry

    def _mismatch(self, arguments: dict[str, object]) -> str:
        missing, extra = sorted(self.names - arguments.keys()), sorted(arguments.keys() - self.names)
        return f"{self.name}(): missing arguments {missing}, unexpected {extra}"


PAGED_DECODE_ATTENTION = CFunction(
    "decode_attention",
    "paged_decode_attention",
    (
        ("q", POINTER), ("k_cache", POINTER), ("v_cache", POINTER), ("block_tables", POINTER),
        ("table_stride", I64), ("seq_lens", POINTER), ("out", POINTER), ("num_rows", I32), ("num_heads", I32),
        ("num_kv_heads", I32), ("head_dim", I32), ("block_size", I32), ("scale", F32), ("num_threads", I32),
    ),
    ctypes.c_int,
)  # fmt: skip
# In the decode_attention library: decode_attention.c includes prefill_attention.c.
PAGED_PREFILL_ATTENTION = CFunction(
    "decode_attention",
    "paged_prefill_attention",
    (
        ("q", POINTER), ("k_cache", POINTER), ("v_cache", POINTER), ("block_tables", POINTER),
        ("table_stride", I64), ("query_start", POINTER), ("query_lens", POINTER), ("seq_lens", POINTER),
        ("out", POINTER), ("num_reqs", I32), ("num_heads", I32), ("num_kv_heads", I32), ("head_dim", I32),
        ("block_size", I32), ("scale", F32), ("bf16", I32), ("num_threads", I32),
    ),
    ctypes.c_int,
)  # fmt: skip
ADD_RMS_NORM = CFunction(
    "elementwise",
    "add_rms_norm",
    (
        ("x", POINTER), ("res", POINTER), ("w", POINTER), ("out", POINTER), ("res_out", POINTER),
        ("rows", I64), ("cols", I64), ("eps", F32), ("num_threads", I32),
    ),
    None,
)  # fmt: skip
ROTARY = CFunction(
    "elementwise",
    "rotary",
    (
        ("x", POINTER), ("stride_t", I64), ("stride_h", I64), ("cos_sin", POINTER), ("out", POINTER),
        ("tokens", I64), ("heads", I64), ("half", I64), ("num_threads", I32),
    ),
    None,
)  # fmt: skip
SILU_AND_MUL = CFunction(
    "elementwise",
    "silu_and_mul",
    (("x", POINTER), ("out", POINTER), ("rows", I64), ("inter", I64), ("num_threads", I32)),
    None,
)
GEMV_ROWS = CFunction(
    "gemv",
    "gemv_rows",
    (
        ("x", POINTER), ("w", POINTER), ("bias", POINTER), ("y", POINTER),
        ("m_dim", I64), ("k_dim", I64), ("n_dim", I64), ("num_threads", I32),
    ),
    None,
)  # fmt: skip
PACKED_LINEAR = CFunction(
    "packed_linear",
    "packed_linear",
    (
        ("w", POINTER), ("x", POINTER), ("bias", POINTER), ("y", POINTER), ("m_dim", I64),
        ("num_threads", I32),
    ),
    None,
)  # fmt: skip
PACKED_FUSED_ROWS = CFunction("packed_linear", "packed_fused_rows", (("w", POINTER),), ctypes.c_int64)
ROUND_ACTIVATIONS = CFunction(
    "packed_linear",
    "round_activations",
    (("x", POINTER), ("rows", I64), ("cols", I64), ("out", POINTER)),
    None,
)
PACKED_DEQUANTIZE = CFunction(
    "packed_linear",
    "packed_dequantize",
    (("w", POINTER), ("start", I64), ("end", I64), ("out", POINTER), ("num_threads", I32)),
    None,
)
PACKED_DEQUANTIZE_BF16 = CFunction(
    "packed_linear",
    "packed_dequantize_bf16",
    (("w", POINTER), ("start", I64), ("end", I64), ("out", POINTER), ("num_threads", I32)),
    None,
)
PACKED_GATHER_ROWS = CFunction(
    "packed_linear",
    "packed_gather_rows",
    (("w", POINTER), ("ids", POINTER), ("n_ids", I64), ("out", POINTER), ("num_threads", I32)),
    None,
)
DECODE_LAYER_SCRATCH = CFunction("decode_layer", "decode_layer_scratch", (("dims", POINTER),), ctypes.c_int64)
DECODE_LAYERS = CFunction(
    "decode_layer",
    "decode_layers",
    (
        ("w", POINTER), ("n_layers", I64), ("dims", POINTER), ("eps", F32), ("scale", F32), ("x", POINTER),
        ("res", POINTER), ("out", POINTER), ("res_out", POINTER), ("cos_sin", POINTER), ("k_caches", POINTER),
        ("v_caches", POINTER), ("slot", I64), ("block_table", POINTER), ("seq_len", I64), ("scratch", POINTER),
        ("num_threads", I32),
    ),
    ctypes.c_int,
)  # fmt: skip
FUNCTIONS = (
    PAGED_DECODE_ATTENTION, PAGED_PREFILL_ATTENTION, ADD_RMS_NORM, ROTARY, SILU_AND_MUL, GEMV_ROWS, PACKED_LINEAR,
    PACKED_FUSED_ROWS, ROUND_ACTIVATIONS, PACKED_DEQUANTIZE, PACKED_DEQUANTIZE_BF16, PACKED_GATHER_ROWS,
    DECODE_LAYER_SCRATCH, DECODE_LAYERS,
)  # fmt: skip
# The KV cache dtypes the C kernels read and write (kv_t in the header), with the suffix of
# the libraries built for each (build.VARIANTS).
KV_DTYPES = {torch.float32: "", torch.float16: "_f16"}


def for_cache(function: CFunction, cache_dtype: torch.dtype) -> CFunction:
    """`function` as built for KV caches of `cache_dtype` (fp32: itself); a clear error for a
    dtype the C kernels do not take."""
    if cache_dtype not in KV_DTYPES:
        raise ValueError(f"the CPU kernels take KV caches of {sorted(map(str, KV_DTYPES))}, not {cache_dtype}")
    suffix = KV_DTYPES[cache_dtype]
    return _in_library(function, function.library + suffix) if suffix else function


@functools.cache
def _in_library(function: CFunction, library: str) -> CFunction:
    """`function` bound from another build (one object each, so it binds once)."""
    return CFunction(library, function.name, function.args, function.restype)


class DecodeWeight(IntEnum):
    """The header's enum decode_weight: a layer's slots in decode_layers' weight array."""

    W_LN1 = 0
    W_LN2 = 1
    W_QKV = 2
    B_QKV = 3
    W_O = 4
    B_O = 5
    W_GATE_UP = 6
    W_DOWN = 7


class DecodeDim(IntEnum):
    """The header's enum decode_dim: the slots of decode_layers' dims array."""

    D_HIDDEN = 0
    D_HEADS = 1
    D_KV_HEADS = 2
    D_HEAD_DIM = 3
    D_INTER = 4
    D_BLOCK_SIZE = 5
