"""The weight formats' names and checks, without torch: what a config, the CLI or the gateway
validates (cadenza.weight_format resolves them to a WeightFormat with torch dtypes)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

DTYPE_NAMES = ("float32", "float16", "bfloat16")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)
# KV cache element types; "auto": the activations' dtype (fp32 on the CPU, the model's on CUDA).
KV_CACHE_DTYPES = ("auto", *DTYPE_NAMES)
# None: a GGUF file keeps its stored types, anything else loads dense in `dtype`.
# "none": dense in `dtype` whatever the file; "gguf": keep a GGUF's types (an error for other
# files); "int8" / "int4": quantize dense weights on load.
QUANTIZATIONS = ("none", "gguf", "int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 32
# The kind (kernels/quant/weight.py) dense weights are stored as, per dtype.
DENSE_KIND = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
# The CPU's many-row GEMMs (prefill chunks, batches past the few-row kernels) over weights in a
# stored format: "auto" is bf16 where dtype resolves to bf16 on a CPU that multiplies it natively.
CPU_GEMM_DTYPES = ("auto", "float32", "bfloat16")
# CPU flags (/proc/cpuinfo) that mean native bf16 dot products.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
CPUINFO = Path("/proc/cpuinfo")
# Overrides the detection of what dtype="auto" means on the CPU (resolve_dtype).
CPU_AUTO_DTYPE_ENV = "CADENZA_CPU_AUTO_DTYPE"
# CPU flags of int8 dot-product instructions (vpdpbusd), where int8_activations is the faster
# decode within the q4 / q8 formats' quality bounds (resolve_int8_activations).
VNNI_CPU_FLAGS = ("avx512_vnni", "avx_vnni")
# CPU flags of the AMX tile units, where bf16 GEMMs keep int8_activations off by default.
AMX_CPU_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")
# Pins what an unset int8_activations means on the CPU ("0" / "1"), whatever each machine's CPU.
CPU_AUTO_INT8_ENV = "CADENZA_CPU_AUTO_INT8_ACTIVATIONS"


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
        if forced not in DTYPE_NAMES:
            raise ValueError(f"{CPU_AUTO_DTYPE_ENV}={forced!r}: choose one of {', '.join(DTYPE_NAMES)}")
        return forced
    flags = cpu_flags() if flags is None else flags
    return "bfloat16" if any(f in flags for f in BF16_CPU_FLAGS) else "float32"


def resolve_int8_activations(
    int8_activations: bool | None,
    dtype: str,
    quantization: str | None,
    device: str,
    flags: frozenset[str] | None = None,
) -> bool:
    """int8_activations unset: on where the C kernels multiply int8 natively (VNNI) and the CPU
    has no AMX, the model's weights stay quantized, and dtype was left "auto" (an explicit
    dtype asks for exact math). Measured with SmolLM2 Q4_1 since the tiled integer batch path
    (kernels/csrc/tiled_batch512.c), ../shared/peers run.sh on each host, in-process single /
    TTFT-512 / 32-stream batch against the same host's default without it: an Ice Lake Xeon
    (VNNI, no bf16) 94 against 73 tok/s decode before that path, which then put its batch and
    TTFT ahead too (docs/formats.md); a Zen 4 (VNNI and AVX512-BF16, whose bf16 GEMMs the
    rounding displaces) 136.8 against 111.0 tok/s, 351 against 519 ms, 437 against 321 tok/s.
    AMX hosts keep it off: their bf16 GEMMs run on the tiles and were not measured against the
    integer path. Perplexity +0.1-0.4% against fp32, inside Q4_1's bound
    (tests/models/test_formats_quality.py). $CADENZA_CPU_AUTO_INT8_ACTIVATIONS (0 / 1)
    overrides the detection (the test suite sets 0: its greedy comparisons with transformers
    are exact)."""
    if int8_activations is not None:
        return int8_activations
    if device.startswith("cuda") or dtype != "auto" or quantization == "none":
        return False
    if flags is None and (forced := os.environ.get(CPU_AUTO_INT8_ENV)):
        if forced not in ("0", "1"):
            raise ValueError(f"{CPU_AUTO_INT8_ENV}={forced!r}: choose 0 or 1")
        return forced == "1"
    flags = cpu_flags() if flags is None else flags
    return any(f in flags for f in VNNI_CPU_FLAGS) and not any(f in flags for f in AMX_CPU_FLAGS)


def resolve_cpu_gemm_dtype(cpu_gemm_dtype: str, resolved_dtype: str) -> str:
    """cpu_gemm_dtype "auto": bfloat16 when the weights' dtype resolved to bf16 and "auto" means
    bf16 on this CPU (native bf16 dot products, or $CADENZA_CPU_AUTO_DTYPE says so), else
    float32: an explicit dtype="float32" keeps every GEMM exact fp32."""
    if cpu_gemm_dtype != "auto":
        return cpu_gemm_dtype
    native = resolve_dtype("auto", "cpu") == "bfloat16"
    return "bfloat16" if native and resolved_dtype == "bfloat16" else "float32"


def check_format(dtype: str, quantization: str | None, group_size: int, cpu_gemm_dtype: str = "auto") -> None:
    if cpu_gemm_dtype not in CPU_GEMM_DTYPES:
        raise ValueError(f"cpu_gemm_dtype must be one of {list(CPU_GEMM_DTYPES)}, got {cpu_gemm_dtype!r}")
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}")
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"quantization_group_size must be one of {list(INT4_GROUP_SIZES)}, got {group_size}")
