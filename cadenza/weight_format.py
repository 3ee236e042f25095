"""How an engine stores its weights: the dtype and quantization settings resolved for the
device at hand (dtype="auto" picks bf16 only where the hardware multiplies it natively).

On the CPU the activations, KV cache and norms stay fp32 whatever the weights' format: the
C kernels read each format and compute in fp32, as llama.cpp does, so `dtype` there is how
dense weights are stored. On CUDA `dtype` is also the activations' and KV cache's dtype.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *DTYPES)
# None: a GGUF file keeps its stored types, anything else loads dense in `dtype`.
# "none": dense in `dtype` whatever the file; "gguf": keep a GGUF's types (an error for other
# files); "int8" / "int4": quantize dense weights on load.
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32
# The kind (kernels/quant/weight.py) dense weights are stored as, per dtype.
DENSE_KIND = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# CPU flags (/proc/cpuinfo) that mean native bf16 dot products.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")
# Overrides the detection of what dtype="auto" means on the CPU (resolve_dtype).
CPU_AUTO_DTYPE_ENV = "CADENZA_CPU_AUTO_DTYPE"


@functools.cache
def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first core's feature flags ("flags" on x86, "Features" on ARM); empty if unknown."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def resolve_dtype(dtype: str, device: str, flags: frozenset[str] | None = None) -> str:
    """dtype "auto": bf16 on CUDA and on CPUs with native bf16 dot products, fp32 elsewhere.
    On the CPU, $CADENZA_CPU_AUTO_DTYPE (float32 / bfloat16 / float16) overrides the detection:
    one fleet-wide meaning of "auto" whatever each machine's CPU (the test suite sets float32,
    so its fp32 comparisons with transformers hold on bf16 CPUs too)."""
    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16"
    if flags is None and (forced := os.environ.get(CPU_AUTO_DTYPE_ENV)):
        if forced not in DTYPES:
            raise ValueError(f"{CPU_AUTO_DTYPE_ENV}={forced!r}: choose one of {', '.join(DTYPES)}")
        return forced
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in BF16_CPU_FLAGS) else "float32"


def check_format(dtype: str, quantization: str | None, group_size: int) -> None:
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {list(INT4_GROUP_SIZES)}, got {group_size}")


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """Resolved settings: dense weights' dtype, on-load quantization, whether GGUF blocks stay.

    dtype: "float32" / "bfloat16" / "float16" (never "auto" here). quantization: None,
    "int8" or "int4" (on load). keep_gguf: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K /
    F16 / BF16 tensors stay as stored. compute_dtype: activations and KV cache.
    """

    dtype: str = "float32"
    quantization: str | None = None
    group_size: int = DEFAULT_INT4_GROUP_SIZE
    keep_gguf: bool = False
    compute_dtype: torch.dtype = torch.float32
    gguf_only: bool = False  # quantization="gguf": an error for a file that is not GGUF
    int8_activations: bool = False  # CPU q4 / q8 kernels read x rounded to int8 (llama.cpp's way)

    @classmethod
    def resolve(
        cls, dtype: str, quantization: str | None, group_size: int, device: str, int8_activations: bool = False
    ) -> WeightFormat:
        check_format(dtype, quantization, group_size)
        resolved = resolve_dtype(dtype, device)
        on_load = quantization if quantization in ("int8", "int4") else None
        compute = DTYPES[resolved] if device.startswith("cuda") else torch.float32
        keep = quantization in (None, "gguf")
        return cls(resolved, on_load, group_size, keep, compute, quantization == "gguf", int8_activations)

    @property
    def dense_kind(self) -> str:
        return DENSE_KIND[self.dtype]

    def describe(self) -> str:
        """A short name for logs and /stats: "int4-g64", "bf16", ..."""
        name = f"int4-g{self.group_size}" if self.quantization == "int4" else self.quantization or self.dense_kind
        return f"{name}-a8" if self.int8_activations else name
