"""Sliding-window and soft-capped attention (kernels/attention/windowed.py) against a dense
masked reference over the same keys laid out contiguously: decode rows batched, short extends
as rows, prefills and long extends per request, windows shorter and longer than contexts,
on scattered blocks whose poisoned block 0 must never be read."""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.paged_batches import HEADS, paged_batch

from cadenza.kernels.attention.reference import gather_kv
from cadenza.kernels.attention.windowed import windowed_attention_ref


def _dense(q, k_cache, v_cache, meta, scale, window, softcap) -> torch.Tensor:  # noqa: ANN001
    """Each request's queries against all its keys, masked by position: the plain definition."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for i, seq_len in enumerate(meta.seq_lens):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        k = gather_kv(k_cache, meta.block_tables[i], seq_len).repeat_interleave(group, dim=1)  # [L, H, D]
        v = gather_kv(v_cache, meta.block_tables[i], seq_len).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        allowed = (k_pos <= q_pos) & ((q_pos - k_pos < window) if window is not None else True)
        probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (37, 50.0), (None, 5.0), (1000, None)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_windowed_attention_matches_the_dense_definition(
    heads: tuple[int, int], window: int | None, softcap: float | None, block_size: int
) -> None:
    torch.manual_seed(block_size + (window or 0))
    # Decodes (short and long contexts), a 3-token extend, a 40-token prefill, a long extend.
    seq_lens, q_lens = [1, 9, 70, 121, 12, 40, 90], [1, 1, 1, 1, 3, 40, 30]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, q_lens, heads, 16, block_size, torch.float32)
    got = windowed_attention_ref(q, k_cache, v_cache, meta, 0.25, window, softcap)
    expected = _dense(q, k_cache, v_cache, meta, 0.25, window, softcap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
