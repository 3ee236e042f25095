"""Cadenza's C kernels for the CPU (kernels/csrc), built on first use and called through ctypes.

They are compiled by the host's C compiler (`CC`, default `cc`) for this very CPU
(-march=native) and cached under CADENZA_CACHE_DIR (default ~/.cache/cadenza), keyed by a hash
of the source and the flags, so a machine builds each kernel once (about a second). Plain C and
ctypes rather than a torch C++ extension: no torch headers, no ninja, nothing to rebuild when
torch changes. Without a compiler, or if the build fails, `load` returns None (and logs why) and
the ops fall back to the torch reference.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCES = Path(__file__).parent / "csrc"
# -fassociative-math (with the two flags it needs) lets the compiler vectorise the dot
# products' reductions; full -ffast-math would also assume no infinities.
CFLAGS = (
    "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared",
    "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math",
)  # fmt: skip
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("CADENZA_CACHE_DIR", Path.home() / ".cache" / "cadenza"))


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The shared library built from csrc/<name>.c, or None when it cannot be built here."""
    source = SOURCES / f"{name}.c"
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        log.warning("no C compiler (%s) on PATH: the CPU runs the torch reference for %s", compiler, name)
        return None
    # Sources may include each other (decode_layer.c includes the rest): hash them all.
    everything = b"".join(path.read_bytes() for path in sorted(SOURCES.glob("*.c")))
    digest = hashlib.sha256(everything + " ".join((compiler, *CFLAGS)).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{digest}.so"
    if not target.exists() and not _build(compiler, source, target):
        return None
    return ctypes.CDLL(str(target))


def _build(compiler: str, source: Path, target: Path) -> bool:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes that race to build never load half a file.
    fd, scratch = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *CFLAGS, str(source), "-o", scratch, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            log.warning("building %s failed; the torch reference runs instead:\n%s", source.name, done.stderr[-2000:])
            return False
        os.replace(scratch, target)
        return True
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)


def _typed(name: str, function: str, argtypes: list[type], restype: type | None = None) -> ctypes.CDLL | None:
    """Library `name`, with `function`'s signature declared on first use."""
    lib = load(name)
    if lib is not None:
        entry = getattr(lib, function)
        if entry.argtypes is None:
            entry.argtypes, entry.restype = argtypes, restype
    return lib


_p, _i64, _i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _decode_attention() -> ctypes.CDLL | None:
    args = [_p, _p, _p, _p, _i64, _p, _p, _i32, _i32, _i32, _i32, _i32, ctypes.c_float, _i32]
    return _typed("decode_attention", "paged_decode_attention", args, ctypes.c_int)


def _gemv() -> ctypes.CDLL | None:
    return _typed("gemv", "gemv_rows", [_p, _p, _p, _p, _i64, _i64, _i64, _i32])


def gemv_available() -> bool:
    return _gemv() is not None


def linear_few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T + bias for contiguous fp32 CPU tensors (the caller checks);
    W is read once whatever M is, so it pays for M up to a handful (see Linear)."""
    lib = _gemv()
    if lib is None:
        raise RuntimeError("the CPU GEMV kernel is not built (see the log for why)")
    x = x.contiguous()
    y = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    bias_ptr = None if bias is None else bias.data_ptr()
    lib.gemv_rows(
        x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), x.shape[0], *weight.shape[::-1],
        torch.get_num_threads(),
    )  # fmt: skip
    return y


def decode_attention_available() -> bool:
    return _decode_attention() is not None


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as attention.paged_decode_attention_ref: q [B, H, D] -> [B, H, D]."""
    lib = _decode_attention()
    if lib is None:
        raise RuntimeError("the CPU decode attention kernel is not built (see the log for why)")
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or q.device.type != "cpu":
        raise ValueError(f"the CPU kernel takes fp32 CPU tensors, not {q.dtype} on {q.device}")
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables, lens = block_tables.contiguous().to(torch.int64), seq_lens.contiguous().to(torch.int64)
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    status = lib.paged_decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
        lens.data_ptr(), out.data_ptr(), batch, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1],
        scale, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the CPU decode attention kernel could not allocate its scratch scores")
    return out


def _elementwise(function: str) -> ctypes.CDLL | None:
    signatures = {
        "add_rms_norm": [_p, _p, _p, _p, _p, _i64, _i64, ctypes.c_float, _i32],
        "rotary": [_p, _i64, _i64, _p, _p, _i64, _i64, _i64, _i32],
        "silu_and_mul": [_p, _p, _i64, _i64, _i32],
    }
    return _typed("elementwise", function, signatures[function])


def elementwise_available() -> bool:
    return load("elementwise") is not None


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as norm.fused_add_rms_norm_triton (residual None: plain RMSNorm)."""
    # NOTE: every tensor whose pointer C reads is bound to a name for the whole call: a
    # temporary `t.contiguous().data_ptr()` copy may be freed before C reads it.
    x, weight = x.contiguous(), weight.contiguous()
    residual = residual.contiguous() if residual is not None else None
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    res_ptr = residual.data_ptr() if residual is not None else None
    cols = x.shape[-1]
    _elementwise("add_rms_norm").add_rms_norm(
        x.data_ptr(), res_ptr, weight.data_ptr(), out.data_ptr(), res_out.data_ptr(),
        x.numel() // cols, cols, eps, torch.get_num_threads(),
    )  # fmt: skip
    return out, res_out


def _rotate_cpu(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    if x.stride(2) != 1:
        x = x.contiguous()
    tokens, heads, dim = x.shape
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    _elementwise("rotary").rotary(
        x.data_ptr(), x.stride(0), x.stride(1), cos_sin.data_ptr(), out.data_ptr(), tokens, heads, dim // 2,
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary_cpu(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as rotary.rotary_ref; q and k may be strided views of the fused qkv output."""
    cos_sin = cos_sin.contiguous().float()
    return _rotate_cpu(q, cos_sin), _rotate_cpu(k, cos_sin)


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    inter = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype)
    _elementwise("silu_and_mul").silu_and_mul(
        x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], inter, torch.get_num_threads()
    )
    return out


def _decode_layers() -> ctypes.CDLL | None:
    args = [_p, _i64, _p, ctypes.c_float, ctypes.c_float, _p, _p, _p, _p, _p, _p, _p, _i64, _p, _i64, _p, _i32]
    lib = _typed("decode_layer", "decode_layers", args, ctypes.c_int)
    return lib if lib is None else _typed("decode_layer", "decode_layer_scratch", [_p], ctypes.c_int64)


def decode_layers_available() -> bool:
    return _decode_layers() is not None


def _pointers(tensors: list[torch.Tensor | None]) -> ctypes.Array:
    return (ctypes.c_void_p * len(tensors))(*[None if t is None else t.data_ptr() for t in tensors])


class DecodeStackKernel:
    """A run of decoder layers' weights, bound for csrc/decode_layer.c (one token, fp32, TP 1).

    `layers[l]` holds layer l's weights in order: input norm, post-attention norm, qkv
    [out, in], qkv bias or None, o [out, in], o bias or None, gate_up [out, in], down
    [out, in]; all contiguous fp32. The tensors are kept here, so the pointers stay valid as
    long as this object lives."""

    def __init__(self, layers: list[list[torch.Tensor | None]], dims: list[int], eps: float, scale: float) -> None:
        lib = _decode_layers()
        if lib is None:
            raise RuntimeError("the CPU decode-layer kernel is not built (see the log for why)")
        for t in (t for weights in layers for t in weights):
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError("the decode-layer kernel takes contiguous fp32 CPU weights")
        self.lib, self.layers, self.eps, self.scale = lib, layers, eps, scale
        self.pointers = _pointers([t for weights in layers for t in weights])
        self.dims = (ctypes.c_int64 * len(dims))(*dims)
        self.scratch = torch.empty(lib.decode_layer_scratch(self.dims), dtype=torch.float32)

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        slot: int,
        block_table: torch.Tensor,
        seq_len: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(last mlp output, residual stream) for one token x [1, hidden], as the layers' forwards."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"{len(self.layers)} layers but {len(kv_caches)} KV caches")
        # Bound to names for the whole call (a temporary copy's pointer may dangle).
        x, cos_sin, block_table = x.contiguous(), cos_sin.contiguous(), block_table.contiguous()
        residual = None if residual is None else residual.contiguous()
        out, res_out = torch.empty_like(x), torch.empty_like(x)
        self.dims[5] = kv_caches[0][0].shape[1]  # the block size is the cache's, known only here
        status = self.lib.decode_layers(
            self.pointers, len(self.layers), self.dims, self.eps, self.scale, x.data_ptr(),
            None if residual is None else residual.data_ptr(), out.data_ptr(), res_out.data_ptr(),
            cos_sin.data_ptr(), _pointers([k for k, _ in kv_caches]), _pointers([v for _, v in kv_caches]),
            slot, block_table.data_ptr(), seq_len, self.scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the CPU decode-layer kernel could not allocate its attention scores")
        return out, res_out
