"""Paged attention in C for the `cpu` backend, reading K/V in place through the block tables
rather than gathering a copy: the one-query rows (csrc/decode_attention.c, split over the
threads by context length) and the long extends/prefills (csrc/prefill_attention.c, tiled
flash-style). Both are in the decode_attention library."""

from __future__ import annotations

import torch

from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.cpu.bindings import KV_DTYPES, PAGED_DECODE_ATTENTION, PAGED_PREFILL_ATTENTION, for_cache


def decode_attention_available() -> bool:
    return PAGED_DECODE_ATTENTION.available()


def reads_cache(k_cache: torch.Tensor) -> bool:
    """Whether the C kernels are built here for a KV cache of this dtype (fp32 or fp16) on the CPU."""
    return (
        k_cache.device.type == "cpu"
        and k_cache.dtype in KV_DTYPES
        and for_cache(PAGED_DECODE_ATTENTION, k_cache.dtype).available()
    )


def _check_native(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if q.dtype != torch.float32 or q.device.type != "cpu":
        raise ValueError(f"the CPU kernel takes fp32 CPU queries, not {q.dtype} on {q.device}")
    if v_cache.dtype != k_cache.dtype or not reads_cache(k_cache):
        raise ValueError(f"the CPU kernel takes fp32 or fp16 CPU KV caches, not {k_cache.dtype} on {k_cache.device}")


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Same contract as reference.paged_decode_attention_ref: q [B, H, D] -> [B, H, D]."""
    _check_native(q, k_cache, v_cache)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables, lens = block_tables.contiguous().to(torch.int64), seq_lens.contiguous().to(torch.int64)
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    status = for_cache(PAGED_DECODE_ATTENTION, k_cache.dtype)(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, table_stride=tables.shape[1], seq_lens=lens,
        out=out, num_rows=batch, num_heads=num_heads, num_kv_heads=k_cache.shape[2], head_dim=head_dim,
        block_size=k_cache.shape[1], scale=scale, num_threads=torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the CPU decode attention kernel could not allocate its scratch")
    return out


def paged_prefill_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    requests: list[int],
    scale: float,
    out: torch.Tensor,
    bf16: bool = False,
) -> None:
    """Same contract as reference.paged_prefill_attention_ref: the listed requests' query
    tokens (rows of q [T, H, D]) into the same rows of out. bf16: QK^T and PV on inputs
    rounded to bf16, fp32 sums, where the CPU has AVX512-BF16 (csrc/prefill_bf16.h)."""
    _check_native(q, k_cache, v_cache)
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    qsl = meta.query_start_loc
    starts = torch.tensor([qsl[i] for i in requests], dtype=torch.int64)
    query_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in requests], dtype=torch.int64)
    seq_lens = torch.tensor([meta.seq_lens[i] for i in requests], dtype=torch.int64)
    tables = meta.block_tables[torch.tensor(requests, dtype=torch.int64)].contiguous().to(torch.int64)
    # The kernel writes only these requests' rows: into out itself when it can address it.
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
    status = for_cache(PAGED_PREFILL_ATTENTION, k_cache.dtype)(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, table_stride=tables.shape[1],
        query_start=starts, query_lens=query_lens, seq_lens=seq_lens, out=target, num_reqs=len(requests),
        num_heads=q.shape[1], num_kv_heads=k_cache.shape[2], head_dim=q.shape[2], block_size=k_cache.shape[1],
        scale=scale, bf16=int(bf16), num_threads=torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("the CPU prefill attention kernel could not allocate its scratch")
    if target is not out:
        for i in requests:
            out[qsl[i] : qsl[i + 1]] = target[qsl[i] : qsl[i + 1]]
