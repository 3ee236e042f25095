"""Paged decode and prefill/extend attention kernels against the torch references.

Caches are filled at random and requests get scattered, non-contiguous blocks; block 0 (the
block-table padding) holds large values that no request owns, so a kernel that reads past a
context's end is caught. Criterion as for the other kernels: within 2x the reference's error.
"""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.kernel_compare import DTYPES, within_2x
from cadenza_testkit.paged_batches import HEADS, paged_batch

from cadenza.kernels.attention.reference import paged_attention_ref, paged_decode_attention_ref
from cadenza.kernels.attention.triton_decode import decode_num_splits, paged_decode_attention_triton
from cadenza.kernels.attention.triton_paged import paged_attention_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_decode_attention(dtype: torch.dtype, heads: tuple[int, int], head_dim: int, block_size: int) -> None:
    """Contexts of 1 token, mid-block ends and many blocks; one split, then forced splits
    (the 1-token and 37-token requests then have empty partitions)."""
    torch.manual_seed(head_dim + block_size + heads[0])
    seq_lens = [37, 1, 300, 129]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, [1] * 4, heads, head_dim, block_size, dtype)
    args = (meta.block_tables, meta.seq_lens_tensor, head_dim**-0.5)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, *args)
    exact = paged_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), *args)
    for splits in (1, 4):
        within_2x(paged_decode_attention_triton(q, k_cache, v_cache, *args, num_splits=splits), ref, exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 8), (128, 16), (64, 32)])
def test_mixed_batch_attention(dtype: torch.dtype, heads: tuple[int, int], head_dim: int, block_size: int) -> None:
    """Two decodes, then extends: q_len 1 after a prefill chunk, a k+1 = 5 token verification,
    a full prefill, and a prefix-cache hit (40 new tokens after 260 cached)."""
    torch.manual_seed(head_dim + block_size + heads[0])
    seq_lens, q_lens = [37, 129, 50, 133, 70, 300], [1, 1, 1, 5, 70, 40]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, q_lens, heads, head_dim, block_size, dtype)
    meta.num_decodes = 2  # request 2 also has one query token but goes down the extend path
    scale = head_dim**-0.5
    ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    exact = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    within_2x(paged_attention_triton(q, k_cache, v_cache, meta, scale), ref, exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(6, 2), (8, 1)])
def test_prefill_only_batch(dtype: torch.dtype, heads: tuple[int, int]) -> None:
    """Full prefills of several lengths in one launch; each spans several row tiles."""
    torch.manual_seed(heads[0])
    seq_lens = [130, 17, 64, 2]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, seq_lens, heads, 64, 16, dtype)
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
    exact = paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    within_2x(paged_attention_triton(q, k_cache, v_cache, meta, 0.125), ref, exact)


def test_decode_split_heuristic() -> None:
    assert decode_num_splits(batch=256, num_kv_heads=8, max_seq_len=32768, sms=132) == 1  # enough programs
    assert decode_num_splits(batch=1, num_kv_heads=8, max_seq_len=300, sms=132) == 1  # too short to split
    long_single = decode_num_splits(batch=1, num_kv_heads=8, max_seq_len=32768, sms=132)
    assert 16 <= long_single <= 64
    assert decode_num_splits(batch=8, num_kv_heads=8, max_seq_len=32768, sms=132) < long_single
    assert decode_num_splits(batch=4, num_kv_heads=2, max_seq_len=4096, sms=1) == 1  # the interpreter
