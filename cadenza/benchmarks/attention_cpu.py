"""CPU paged attention micro-benchmark (SmolLM2-135M's attention shapes), as JSON.

Decode: one layer's attention for a batch of rows at a context length, the old paths (the
torch reference, which gathers a padded copy, and the C kernel of OLD_REV, one work item per
(row, KV head)) against the current C kernel; each call reads every row's K and V once, so
the figure of merit is GB/s beside the machine's read bandwidth measured in the same run.
Calls cycle through up to 30 layers' worth of distinct caches (SmolLM2 has 30), at least
POOL_BYTES of them when the context allows, so K/V come from memory as in a real decode
step, not from a cache the previous call left warm. `--kv-dtype float16` runs the decode cases
on fp16 caches (the C kernel's CADENZA_KV_F16 build; the old kernel read fp32 only).

Prefill: one layer's attention for a prompt run as chunks of `--chunk` tokens over the paged
cache (chunk i attends to everything before it), the torch reference (gather + SDPA) against
the tiled C kernel: GFLOP/s, counting 4 * causal (query, key) pairs * D * H, beside the
machine's fp32 GEMM rate (torch.mm 2048 x 2048) measured in the same run.

    .venv/bin/python -m cadenza.benchmarks.attention_cpu [--contexts ...] [--batches ...] [--prompts ...]
        [--kv-dtype float32|float16]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from cadenza.benchmarks.offline import measure_gemm_gflops, measure_read_gbps
from cadenza.kernels.attention.cpu import paged_decode_attention_cpu, paged_prefill_attention_cpu
from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.attention.reference import paged_attention_ref, paged_decode_attention_ref
from cadenza.kernels.cpu import build
from cadenza.kernels.cpu.bindings import PAGED_DECODE_ATTENTION

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 9, 3, 64, 16, 30
SCALE = HEAD_DIM**-0.5
POOL_BYTES = 320 << 20  # K + V: more than 30 layers of one 6144-token row, 10x this host's L3
OLD_REV = "3803305"  # the last commit with the one-item-per-(row, KV head) decode kernel
REPO = Path(__file__).resolve().parent.parent

DecodeFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def old_decode_kernel(rev: str) -> DecodeFn | None:
    """The decode kernel as it was at `rev`, built like the current one; None without git or cc."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in ("decode_attention.c", "cadenza_kernels.h"):
                text = subprocess.run(
                    ["git", "show", f"{rev}:kernels/csrc/{name}"], cwd=REPO, capture_output=True, check=True
                ).stdout
                (Path(tmp) / name).write_bytes(text)
            target = Path(tmp) / "old.so"
            command = [build.compiler(), *build.CFLAGS, str(Path(tmp) / "decode_attention.c"), "-o", str(target), "-lm"]
            subprocess.run(command, capture_output=True, check=True)
            entry = ctypes.CDLL(str(target)).paged_decode_attention  # stays mapped after the file goes
        except (OSError, subprocess.CalledProcessError):
            return None
    entry.argtypes, entry.restype = [kind for _, kind in PAGED_DECODE_ATTENTION.args], ctypes.c_int
    return lambda q, k, v, tables, lens, scale: _call_old(entry, q, k, v, tables, lens, scale)


def _call_old(
    entry: Callable[..., int],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    status = entry(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        out.data_ptr(), q.shape[0], HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, scale, torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the old decode kernel could not allocate")
    return out


def _layer_tables(num_blocks: int, batch: int, context: int) -> list[torch.Tensor]:
    """Block tables of as many distinct layers as the pool holds (at most LAYERS), each row's
    blocks shuffled within its layer's share of the pool (block 0 is never handed out)."""
    per_row = -(-context // BLOCK_SIZE)
    layers = max(1, min(LAYERS, (num_blocks - 1) // (per_row * batch)))
    tables = []
    for layer in range(layers):
        base = 1 + layer * per_row * batch
        ids = torch.randperm(per_row * batch) + base
        tables.append(ids.view(batch, per_row).contiguous())
    return tables


def _time_cycle(call: Callable[[int], object], count: int, min_seconds: float) -> float:
    """Seconds per call of call(i), i cycling over range(count): the best of whole passes
    (after a warm one) run for min_seconds, so a pass the host's other tenants preempted or
    starved of bandwidth does not count."""
    for i in range(count):
        call(i)
    best, start = float("inf"), time.perf_counter()
    while time.perf_counter() - start < min_seconds or best == float("inf"):
        began = time.perf_counter()
        for i in range(count):
            call(i)
        best = min(best, (time.perf_counter() - began) / count)
    return best


def decode_case(
    pool: tuple[torch.Tensor, torch.Tensor], context: int, batch: int, kernels: dict[str, DecodeFn], seconds: float
) -> dict[str, object]:
    k_cache, v_cache = pool
    tables = _layer_tables(k_cache.shape[0], batch, context)
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, HEAD_DIM)
    kv_bytes = batch * context * KV_HEADS * HEAD_DIM * k_cache.element_size() * 2
    case: dict[str, object] = {"context": context, "batch": batch, "layers_cycled": len(tables), "kv_bytes": kv_bytes}
    expected = paged_decode_attention_ref(q, k_cache, v_cache, tables[0], lens, SCALE)
    for name, kernel in kernels.items():
        err = (kernel(q, k_cache, v_cache, tables[0], lens, SCALE) - expected).abs().max().item()
        per_call = _time_cycle(partial(_decode_layer, kernel, q, pool, tables, lens), len(tables), seconds)
        case[name] = {"ms": round(per_call * 1e3, 4), "gbps": round(kv_bytes / per_call / 1e9, 2), "max_err": err}
    return case


def _decode_layer(
    kernel: DecodeFn,
    q: torch.Tensor,
    pool: tuple[torch.Tensor, torch.Tensor],
    tables: list[torch.Tensor],
    lens: torch.Tensor,
    layer: int,
) -> torch.Tensor:
    return kernel(q, *pool, tables[layer], lens, SCALE)


def _chunk_meta(q_len: int, seq_len: int, table: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.int64),
        query_start_loc=[0, q_len],
        seq_lens=[seq_len],
        seq_lens_tensor=torch.tensor([seq_len]),
        block_tables=table,
        num_decodes=0,
    )


def _prefill_pass(
    chunks: list[tuple[torch.Tensor, AttentionMetadata]], caches: tuple[torch.Tensor, torch.Tensor], native: bool
) -> tuple[float, list[torch.Tensor]]:
    """Seconds for every chunk's attention, and the outputs."""
    outs, total = [], 0.0
    for q, meta in chunks:
        meta.decode_plan = None
        ops = {"decode": paged_decode_attention_cpu, "long": paged_prefill_attention_cpu} if native else {}
        start = time.perf_counter()
        outs.append(paged_attention_ref(q, *caches, meta, SCALE, **ops))
        total += time.perf_counter() - start
    return total, outs


def prefill_case(prompt: int, chunk: int, repeats: int) -> dict[str, object]:
    blocks = -(-prompt // BLOCK_SIZE)
    shape = (blocks + 1, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = (torch.randn(shape), torch.randn(shape))
    table = (torch.randperm(blocks) + 1)[None]
    chunks, pairs = [], 0
    for start in range(0, prompt, chunk):
        end = min(prompt, start + chunk)
        chunks.append((torch.randn(end - start, HEADS, HEAD_DIM), _chunk_meta(end - start, end, table)))
        pairs += (start + 1 + end) * (end - start) // 2  # query at position p sees p + 1 keys
    flops = 4 * pairs * HEAD_DIM * HEADS
    case: dict[str, object] = {"prompt": prompt, "chunk": chunk, "flops": flops}
    old_seconds, expected = _prefill_pass(chunks, caches, native=False)
    new_seconds = min(_prefill_pass(chunks, caches, native=True)[0] for _ in range(repeats))
    got = _prefill_pass(chunks, caches, native=True)[1]
    err = max((a - b).abs().max().item() for a, b in zip(got, expected, strict=True))
    for name, seconds in (("old_gather_sdpa", old_seconds), ("new", new_seconds)):
        case[name] = {"ms": round(seconds * 1e3, 2), "gflops": round(flops / seconds / 1e9, 2)}
    case["max_err"] = err
    return case


def _warm_up_sdpa() -> None:
    """SDPA's first call pays one-time set-up that is no part of the comparison."""
    q = torch.randn(1, HEADS, 64, HEAD_DIM)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 6144])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompts", type=int, nargs="*", default=[2048, 6144])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=0.3, help="time per decode kernel and case")
    parser.add_argument("--old-rev", default=OLD_REV, help="git revision of the old decode kernel")
    parser.add_argument(
        "--kv-dtype", choices=["float32", "float16"], default="float32", help="the decode cases' KV cache dtype"
    )
    args = parser.parse_args(argv)
    kv_dtype = getattr(torch, args.kv_dtype)
    torch.manual_seed(0)
    result: dict[str, object] = {"threads": torch.get_num_threads(), "kv_dtype": args.kv_dtype}
    result["machine"] = {
        "read_gbps": round(measure_read_gbps(1024), 2),
        "gemm_gflops": round(measure_gemm_gflops(2048, 5), 2),
    }
    kernels: dict[str, DecodeFn] = {"torch_ref": paged_decode_attention_ref}
    old = old_decode_kernel(args.old_rev) if kv_dtype == torch.float32 else None  # the old kernel read fp32 only
    if old is not None:
        kernels["old_c"] = old
    kernels["new"] = paged_decode_attention_cpu
    pool_blocks = POOL_BYTES // (2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * kv_dtype.itemsize)
    pool = tuple(torch.empty(pool_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).normal_().to(kv_dtype) for _ in range(2))
    result["decode"] = [
        decode_case(pool, context, batch, kernels, args.seconds) for batch in args.batches for context in args.contexts
    ]
    del pool
    _warm_up_sdpa()
    result["prefill"] = [prefill_case(prompt, args.chunk, repeats=2) for prompt in args.prompts]
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
