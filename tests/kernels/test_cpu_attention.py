"""The `cpu` backend's C attention kernels against the torch reference, fp32, tight bounds;
over fp32 and fp16 KV caches (the reference reads the same fp16 values widened, so the bounds
stay fp32's: what fp16 costs against fp32 is the engine tests' business).

Decode (csrc/decode_attention.c) splits each row's context over the threads and combines the
partial softmaxes; prefill/extend (csrc/prefill_attention.c) tiles queries and keys flash-
style over the paged cache. Both read K/V in place through shuffled block tables, with block 0
(table padding) full of 8.0 so a read past a context's end shows (tests/kernels/
test_attention_kernels.py's paged_batch). Shapes cover MHA, GQA and MQA; head_dim 64, 16,
40 and 12 (not a multiple of 8 or 6: the kernels' tails); block sizes 1, 16 and 32; contexts
and query runs that end mid-block and mid-tile.
"""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.paged_batches import paged_batch

from cadenza.format_names import BF16_CPU_FLAGS, cpu_flags
from cadenza.kernels.attention import cpu as attention_cpu
from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.kernels.attention.reference import (
    paged_attention_ref,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
)
from cadenza.kernels.cpu.bindings import PAGED_DECODE_ATTENTION, for_cache

pytestmark = pytest.mark.skipif(
    not attention_cpu.decode_attention_available(), reason="no C compiler: the CPU kernels cannot be built here"
)

# (query heads, KV heads): MHA, SmolLM2's GQA 3, GQA 8, MQA.
HEADS = [(4, 4), (9, 3), (16, 2), (4, 1)]
SHAPES = [(64, 16), (16, 1), (40, 32), (12, 16)]  # (head_dim, block_size)
TOL = {"atol": 1e-5, "rtol": 1e-5}
CACHE_DTYPES = [torch.float32, torch.float16]


def _narrowed(k_cache: torch.Tensor, v_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return k_cache.to(dtype), v_cache.to(dtype)


def _decode_with_threads(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, threads: int
) -> torch.Tensor:
    """The decode kernel through its binding with an explicit thread count: the split plan
    (how many chunks a row's context becomes) depends on it."""
    out = torch.empty_like(q)
    tables = meta.block_tables.to(torch.int64).contiguous()
    status = for_cache(PAGED_DECODE_ATTENTION, k_cache.dtype)(
        q=q, k_cache=k_cache, v_cache=v_cache, block_tables=tables, table_stride=tables.shape[1],
        seq_lens=meta.seq_lens_tensor, out=out, num_rows=q.shape[0], num_heads=q.shape[1],
        num_kv_heads=k_cache.shape[2], head_dim=q.shape[2], block_size=k_cache.shape[1],
        scale=q.shape[2] ** -0.5, num_threads=threads,
    )  # fmt: skip
    assert status == 0
    return out


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("head_dim", "block_size"), SHAPES)
def test_decode_rows_match_the_reference(
    heads: tuple[int, int], head_dim: int, block_size: int, cache_dtype: torch.dtype
) -> None:
    """One-token contexts, mid-block ends, and contexts long enough to split in several."""
    torch.manual_seed(head_dim + block_size + heads[0])
    seq_lens = [1, 37, 700, 129, 16, 300]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, [1] * len(seq_lens), heads, head_dim, block_size, torch.float32)
    k_cache, v_cache = _narrowed(k_cache, v_cache, cache_dtype)
    args = (meta.block_tables, meta.seq_lens_tensor, head_dim**-0.5)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, *args)
    torch.testing.assert_close(attention_cpu.paged_decode_attention_cpu(q, k_cache, v_cache, *args), expected, **TOL)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("seq_lens", [[2000], [1, 1500], [129, 5, 1024, 64, 333, 17, 800, 2]])
def test_every_split_plan_gives_the_same_answer(threads: int, seq_lens: list[int], cache_dtype: torch.dtype) -> None:
    """A lone long row splits up to 8 x threads ways; a big batch not at all."""
    torch.manual_seed(threads + len(seq_lens))
    q, k_cache, v_cache, meta = paged_batch(seq_lens, [1] * len(seq_lens), (9, 3), 64, 16, torch.float32)
    k_cache, v_cache = _narrowed(k_cache, v_cache, cache_dtype)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, 0.125)
    torch.testing.assert_close(_decode_with_threads(q, k_cache, v_cache, meta, threads), expected, **TOL)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("head_dim", "block_size"), SHAPES)
def test_a_ragged_batch_matches_the_reference(
    heads: tuple[int, int], head_dim: int, block_size: int, cache_dtype: torch.dtype
) -> None:
    """Decodes, a k+1 = 5 verification and a 16-token extend (decode rows), then long runs: a
    17-token extend, a fresh prefill of 70, an extend of 100 after 233 cached, a fresh prefill
    of 129 and an extend of 33 after 1 cached (runs that end mid-tile and mid-block)."""
    torch.manual_seed(head_dim + block_size + heads[0])
    seq_lens = [37, 300, 50, 133, 40, 70, 333, 129, 34]
    q_lens = [1, 1, 5, 16, 17, 70, 100, 129, 33]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, q_lens, heads, head_dim, block_size, torch.float32)
    k_cache, v_cache = _narrowed(k_cache, v_cache, cache_dtype)
    scale = head_dim**-0.5
    expected = paged_attention_ref(q, k_cache, v_cache, meta, scale)
    meta.decode_plan = None
    got = paged_attention_ref(
        q, k_cache, v_cache, meta, scale,
        decode=attention_cpu.paged_decode_attention_cpu, long=attention_cpu.paged_prefill_attention_cpu,
    )  # fmt: skip
    torch.testing.assert_close(got, expected, **TOL)


@pytest.mark.parametrize(
    ("threads", "cache_dtype"), [(1, torch.float32), (2, torch.float32), (5, torch.float32), (2, torch.float16)]
)
def test_a_long_prompt_in_chunks_matches_the_reference(threads: int, cache_dtype: torch.dtype) -> None:
    """SmolLM2's shapes, a 1000-token prompt as chunks of 384 over the paged cache: chunk i
    attends to all before it; many query tiles and key tiles, the diagonal ones masked."""
    torch.manual_seed(threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        q_all, k_cache, v_cache, meta = paged_batch([1000], [1000], (9, 3), 64, 16, torch.float32)
        k_cache, v_cache = _narrowed(k_cache, v_cache, cache_dtype)
        for start in range(0, 1000, 384):
            end = min(1000, start + 384)
            chunk = AttentionMetadata(
                slot_mapping=meta.slot_mapping, query_start_loc=[0, end - start], seq_lens=[end],
                seq_lens_tensor=torch.tensor([end]), block_tables=meta.block_tables, num_decodes=0,
            )  # fmt: skip
            q = q_all[start:end]
            expected = torch.empty_like(q)
            paged_prefill_attention_ref(q, k_cache, v_cache, chunk, [0], 0.125, expected)
            got = torch.full_like(q, float("nan"))
            attention_cpu.paged_prefill_attention_cpu(q, k_cache, v_cache, chunk, [0], 0.125, got)
            torch.testing.assert_close(got, expected, **TOL)
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [((9, 3), 64), ((4, 4), 128), ((16, 2), 64), ((4, 2), 40)])
def test_bf16_products_err_as_bf16_inputs_do(heads: tuple[int, int], head_dim: int, cache_dtype: torch.dtype) -> None:
    """bf16=True (csrc/prefill_bf16.h), an extend of 100 after 233 cached and a fresh prefill
    of 129 (odd key counts, tiles ending mid-pair): where the CPU has AVX512-BF16 and D % 16
    == 0 its error against the fp32 reference is the error of the reference itself run on
    bf16-rounded q, K and V (mean and max within 1.5x and 2x), and not zero: the bf16 path ran.
    Elsewhere the flag is ignored: exactly the fp32 kernel."""
    torch.manual_seed(head_dim + heads[0])
    q, k_cache, v_cache, meta = paged_batch([333, 129], [100, 129], heads, head_dim, 16, torch.float32)
    k_cache, v_cache = _narrowed(k_cache, v_cache, cache_dtype)
    scale, requests = head_dim**-0.5, [0, 1]

    def run(bf16: bool) -> torch.Tensor:
        out = torch.zeros_like(q)
        attention_cpu.paged_prefill_attention_cpu(q, k_cache, v_cache, meta, requests, scale, out, bf16)
        return out

    exact = torch.zeros_like(q)
    paged_prefill_attention_ref(q, k_cache.float(), v_cache.float(), meta, requests, scale, exact)
    got = run(True)
    if not (BF16_CPU_FLAGS[0] in cpu_flags() and head_dim % 16 == 0):
        assert torch.equal(got, run(False))
        return
    rounded = torch.zeros_like(q)

    def bf16(t: torch.Tensor) -> torch.Tensor:
        return t.bfloat16().float()

    paged_prefill_attention_ref(bf16(q), bf16(k_cache.float()), bf16(v_cache.float()), meta, requests, scale, rounded)
    ours, inputs = (got - exact).abs(), (rounded - exact).abs()
    assert 0 < ours.mean() <= 1.5 * inputs.mean()
    assert ours.max() <= 2 * inputs.max()


def test_the_prefill_kernel_writes_only_its_requests_rows() -> None:
    """Into a non-contiguous out (a transposed buffer's view) and a strided q: the listed
    requests' rows are the reference's, every other row is left as it was."""
    torch.manual_seed(3)
    seq_lens, q_lens = [90, 40, 300], [20, 40, 64]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, q_lens, (6, 2), 64, 16, torch.float32)
    q_strided = torch.cat([q, torch.randn_like(q)], dim=-1)[..., :64]  # as a view of a fused qkv would be
    assert not q_strided.is_contiguous()
    q_strided.copy_(q)
    expected = torch.zeros_like(q)
    paged_prefill_attention_ref(q, k_cache, v_cache, meta, [0, 2], 0.125, expected)
    out = torch.zeros(q.shape[2], q.shape[1], q.shape[0]).permute(2, 1, 0)
    assert not out.is_contiguous()
    attention_cpu.paged_prefill_attention_cpu(q_strided, k_cache, v_cache, meta, [0, 2], 0.125, out)
    torch.testing.assert_close(out, expected, **TOL)  # request 1's rows stay zero in both


def test_the_prefill_kernel_refuses_what_it_cannot_read() -> None:
    q, k_cache, v_cache, meta = paged_batch([40], [40], (2, 2), 64, 16, torch.float32)
    with pytest.raises(ValueError, match="fp32 CPU"):
        attention_cpu.paged_prefill_attention_cpu(q.half(), k_cache, v_cache, meta, [0], 0.125, torch.empty_like(q))
    bf16 = k_cache.bfloat16(), v_cache.bfloat16()
    with pytest.raises(ValueError, match="fp32 or fp16 CPU KV caches"):
        attention_cpu.paged_prefill_attention_cpu(q, *bf16, meta, [0], 0.125, torch.empty_like(q))
    with pytest.raises(ValueError, match="fp32 or fp16 CPU KV caches"):
        attention_cpu.paged_decode_attention_cpu(q, *bf16, meta.block_tables, meta.seq_lens_tensor, 0.125)
