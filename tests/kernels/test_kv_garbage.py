"""Attention over a KV pool whose never-written slots hold garbage.

The pool is allocated lazily (actors/model_runner.zeroed_kv_tensor): fresh pages read as
zeros, but a path is only garbage-proof if it never lets an unwritten slot reach its output.
Here every slot a request does not own holds NaN: the tail of its last block, the padding
entries of its block table (block 0) and every other block. Each path must give finite
outputs equal to those over a zero-filled pool with the same written slots.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import pytest
import torch

from cadenza.actors.model_runner import zeroed_kv_tensor
from cadenza.kernels.attention.cpu import decode_attention_available, paged_decode_attention_cpu
from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.attention.reference import paged_attention_ref
from cadenza.kernels.ops import bind_kernels

BLOCK_SIZE, NUM_BLOCKS, HEADS, KV_HEADS, HEAD_DIM = 4, 24, 4, 2, 8
SCALE = HEAD_DIM**-0.5
# (context length after the step, query tokens): decodes whose short contexts are padded up
# to the longest one's blocks, a short extend (a batched decode row per token) and a prefill
# longer than SHORT_EXTEND_TOKENS (its own causal attention).
DECODES = [(1, 1), (3, 1), (9, 1)]
MIXED = [(2, 1), (10, 1), (7, 3), (21, 21)]


def _batch(reqs: list[tuple[int, int]], device: str) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Queries, the slots the requests own (written before attention runs) and the metadata.
    Blocks from 1 up, so table padding (block 0) is a block no request wrote."""
    tables, slots, next_block = [], [], 1
    for seq_len, _ in reqs:
        blocks = list(range(next_block, next_block + -(-seq_len // BLOCK_SIZE)))
        next_block += len(blocks)
        tables.append(blocks)
        slots += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(seq_len)]
    width = max(map(len, tables))
    qsl = [0]
    for _, q_len in reqs:
        qsl.append(qsl[-1] + q_len)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=device),  # attention does not write
        query_start_loc=qsl,
        seq_lens=[n for n, _ in reqs],
        seq_lens_tensor=torch.tensor([n for n, _ in reqs], device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
        num_decodes=next((i for i, (_, q) in enumerate(reqs) if q != 1), len(reqs)),
    )
    q = torch.randn(qsl[-1], HEADS, HEAD_DIM, device=device)
    return q, torch.tensor(slots, device=device), meta


def _pools(slots: torch.Tensor, fill: float, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V caches holding `fill` everywhere but the owned slots, which get the same
    values whatever the fill (the generator is reseeded)."""
    shape = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    gen = torch.Generator().manual_seed(1)
    caches = []
    for _ in range(2):
        cache = torch.full(shape, fill, device=device)
        flat = cache.view(-1, KV_HEADS, HEAD_DIM)
        flat[slots] = torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen).to(device)
        caches.append(cache)
    return caches[0], caches[1]


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor]


def _run_both(reqs: list[tuple[int, int]], attend: Attend, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    q, slots, meta = _batch(reqs, device)
    k0, v0 = _pools(slots, 0.0, device)
    kn, vn = _pools(slots, float("nan"), device)
    clean = attend(q, k0, v0, meta, SCALE)
    return clean, attend(q, kn, vn, meta, SCALE)


def _assert_garbage_proof(clean: torch.Tensor, garbage: torch.Tensor) -> None:
    assert torch.isfinite(clean).all()
    assert torch.isfinite(garbage).all(), "an unwritten slot reached the output"
    torch.testing.assert_close(garbage, clean, rtol=0, atol=0)


needs_c_kernel = pytest.mark.skipif(not decode_attention_available(), reason="no C compiler for the CPU kernels")


@needs_c_kernel
@pytest.mark.parametrize("reqs", [DECODES, MIXED], ids=["decodes", "mixed"])
def test_the_cpu_kernel_path_never_reads_unwritten_slots(reqs: list[tuple[int, int]]) -> None:
    """The `cpu` backend: the reference's plan with its one-query rows in C (positions < seq_len)."""
    attend = lambda *a: paged_attention_ref(*a, decode=paged_decode_attention_cpu)
    _assert_garbage_proof(*_run_both(reqs, attend))


@needs_c_kernel
def test_the_cpu_dispatch_never_reads_unwritten_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENZA_KERNELS", "cpu")
    kernels = bind_kernels(torch.device("cpu"))  # bound after the backend is set, as a model's
    assert kernels.backend == "cpu"
    _assert_garbage_proof(*_run_both(MIXED, kernels.paged_attention))


def test_the_reference_prefill_reads_only_owned_slots() -> None:
    """A prefill longer than SHORT_EXTEND_TOKENS gathers exactly its seq_len rows."""
    _assert_garbage_proof(*_run_both([(21, 21)], paged_attention_ref))


@pytest.mark.parametrize("reqs", [[(3, 1)], DECODES, MIXED], ids=["one-decode", "decodes", "mixed"])
def test_the_torch_reference_decode_rows_over_garbage(reqs: list[tuple[int, int]]) -> None:
    _assert_garbage_proof(*_run_both(reqs, paged_attention_ref))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reqs", [DECODES, MIXED], ids=["decodes", "mixed"])
def test_the_triton_path_never_reads_unwritten_slots(reqs: list[tuple[int, int]]) -> None:
    from cadenza.kernels.attention.triton_paged import paged_attention_triton

    _assert_garbage_proof(*_run_both(reqs, paged_attention_triton, device="cuda"))


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS line")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_runners_pool_reads_zero_and_is_resident_only_where_written(dtype: torch.dtype) -> None:
    """What makes the reference path safe and the idle pool free: zero pages, committed on write."""
    shape = (4096, 16, 4, 64)  # 32 MiB in fp32
    nbytes = 4096 * 16 * 4 * 64 * dtype.itemsize
    gc.collect()
    before = _rss_bytes()
    cache = zeroed_kv_tensor(shape, dtype, torch.device("cpu"))
    cache[:64] = 1.0  # 64 blocks written
    grown = _rss_bytes() - before
    block_bytes = nbytes // 4096
    assert 32 * block_bytes <= grown < nbytes // 4, f"{grown} bytes resident"
    assert cache.is_contiguous() and cache.shape == shape and cache.dtype == dtype
    assert not cache[64:128].any()  # (a read: pages committed only now, on this kernel even by reads)
    del cache
    gc.collect()
    assert _rss_bytes() - before < nbytes // 4, "the mapping outlived its tensor"
