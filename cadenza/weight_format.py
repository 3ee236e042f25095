"""How an engine stores its weights: the dtype and quantization settings resolved for the
device at hand (dtype="auto" picks bf16 only where the hardware multiplies it natively).

On the CPU the activations, KV cache and norms stay fp32 whatever the weights' format: the
C kernels read each format and compute in fp32, as llama.cpp does, so `dtype` there is how
dense weights are stored. The one exception is gemm_dtype: the many-row GEMMs of prefill
and large batches (tiles of a stored weight times x) run in bf16 where the CPU multiplies
bf16 natively and dtype resolved to bf16 (~2.8x fp32's rate on AVX512-BF16), their results
back in fp32. On CUDA `dtype` is also the activations' and KV cache's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadenza.format_names import (  # noqa: F401 - every format user reads these from here
    BF16_CPU_FLAGS,
    CPU_AUTO_DTYPE_ENV,
    CPU_GEMM_DTYPES,
    CPUINFO,
    DEFAULT_INT4_GROUP_SIZE,
    DENSE_KIND,
    DTYPE_CHOICES,
    DTYPE_NAMES,
    INT4_GROUP_SIZES,
    QUANTIZATIONS,
    check_format,
    cpu_flags,
    resolve_cpu_gemm_dtype,
    resolve_dtype,
    resolve_int8_activations,
)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """Resolved settings: dense weights' dtype, on-load quantization, whether GGUF blocks stay.

    dtype: "float32" / "bfloat16" / "float16" (never "auto" here). quantization: None,
    "int8" or "int4" (on load). keep_gguf: a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K /
    F16 / BF16 tensors stay as stored. compute_dtype: activations. kv_dtype: the KV cache's
    elements (None: compute_dtype). gemm_dtype: the CPU's many-row GEMMs over stored weights.
    """

    dtype: str = "float32"
    quantization: str | None = None
    group_size: int = DEFAULT_INT4_GROUP_SIZE
    keep_gguf: bool = False
    compute_dtype: torch.dtype = torch.float32
    gguf_only: bool = False  # quantization="gguf": an error for a file that is not GGUF
    int8_activations: bool = False  # CPU q4 / q8 kernels read x rounded to int8 (llama.cpp's way)
    kv_dtype: torch.dtype | None = None
    gemm_dtype: torch.dtype = torch.float32

    @classmethod
    def resolve(
        cls,
        dtype: str,
        quantization: str | None,
        group_size: int,
        device: str,
        int8_activations: bool | None = None,
        kv_cache_dtype: str = "auto",
        cpu_gemm_dtype: str = "auto",
    ) -> WeightFormat:
        check_format(dtype, quantization, group_size, cpu_gemm_dtype)
        resolved = resolve_dtype(dtype, device)
        on_load = quantization if quantization in ("int8", "int4") else None
        on_cuda = device.startswith("cuda")
        compute = DTYPES[resolved] if on_cuda else torch.float32
        keep = quantization in (None, "gguf")
        gemm = compute if on_cuda else DTYPES[resolve_cpu_gemm_dtype(cpu_gemm_dtype, resolved)]
        int8_x = resolve_int8_activations(int8_activations, dtype, quantization, device)
        rounded = not on_cuda and (gemm == torch.bfloat16 or int8_x)
        kv = _auto_kv_dtype(compute, rounded) if kv_cache_dtype == "auto" else DTYPES[kv_cache_dtype]
        if on_cuda and kv != compute:
            raise ValueError(f"on CUDA the KV cache is in the activations' dtype ({compute}), not {kv_cache_dtype}")
        gguf_only = quantization == "gguf"
        return cls(resolved, on_load, group_size, keep, compute, gguf_only, int8_x, kv, gemm)

    def cache_dtype(self, activations: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model whose activations are `activations`."""
        return self.kv_dtype or activations

    @property
    def dense_kind(self) -> str:
        return DENSE_KIND[self.dtype]

    def describe(self) -> str:
        """A short name for logs and /stats: "int4-g64", "bf16", ..."""
        name = f"int4-g{self.group_size}" if self.quantization == "int4" else self.quantization or self.dense_kind
        return f"{name}-a8" if self.int8_activations else name


def _auto_kv_dtype(compute: torch.dtype, rounded: bool) -> torch.dtype:
    """kv_cache_dtype "auto": the activations' dtype, except on a CPU whose activations are
    rounded already (prefill GEMMs in bf16, or int8 activations), where fp16 K/V, finer than
    either, halve the pool's bytes and what decode attention reads: SmolLM2 at 6144 tokens on
    a Zen 4, 44.2-44.7 against 32.0-34.7 tok/s; the served 32-stream batch's resident memory
    on an Ice Lake (int8 activations), 953 to 754 MB (../shared/peers, `--only served`)."""
    return torch.float16 if rounded else compute
