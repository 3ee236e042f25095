"""The C kernels of the `cpu` backend (kernels/csrc, through kernels/cpu) against the torch
references: decode attention, the one-row GEMV, norm, rotary and SiLU-and-mul.

Attention uses the same batches as the Triton tests (scattered blocks; block 0 is padding full of 8.0 that no
request owns, so reading past a context's end shows). fp32 in and out, so the bound is tight.
"""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.paged_batches import HEADS, paged_batch

from cadenza.kernels import ops
from cadenza.kernels.activation import silu_and_mul_ref
from cadenza.kernels.attention import cpu as attention_cpu
from cadenza.kernels.attention.reference import paged_attention_ref, paged_decode_attention_ref
from cadenza.kernels.backend import host_backend
from cadenza.kernels.cpu import bindings, build, decode_stack, elementwise, gemv
from cadenza.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from cadenza.kernels.rotary import rotary_ref

pytestmark = pytest.mark.skipif(
    not attention_cpu.decode_attention_available(), reason="no C compiler: the CPU kernel cannot be built here"
)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize(("head_dim", "block_size"), [(64, 16), (128, 8), (64, 32)])
def test_decode_rows_match_the_reference(heads: tuple[int, int], head_dim: int, block_size: int) -> None:
    torch.manual_seed(head_dim + block_size + heads[0])
    seq_lens = [37, 1, 300, 129, 16]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, [1] * 5, heads, head_dim, block_size, torch.float32)
    args = (meta.block_tables, meta.seq_lens_tensor, head_dim**-0.5)
    expected = paged_decode_attention_ref(q, k_cache, v_cache, *args)
    got = attention_cpu.paged_decode_attention_cpu(q, k_cache, v_cache, *args)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_a_mixed_batch_through_the_cpu_backend_matches_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes, a k+1 verification (short extend rows), a prefill and a prefix-cache extend."""
    torch.manual_seed(1)
    seq_lens, q_lens = [37, 129, 50, 133, 70, 300], [1, 1, 1, 5, 70, 40]
    q, k_cache, v_cache, meta = paged_batch(seq_lens, q_lens, (6, 2), 64, 16, torch.float32)
    expected = paged_attention_ref(q, k_cache, v_cache, meta, 0.125)
    monkeypatch.setenv("CADENZA_KERNELS", "cpu")
    kernels = ops.bind_kernels(q.device)  # the backend is read when bound, as for a model
    assert kernels.backend == "cpu"
    meta.decode_plan = None  # the reference run above planned this batch already
    got = kernels.paged_attention(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=1e-5)


def test_the_kernel_refuses_what_it_cannot_read() -> None:
    q, k_cache, v_cache, meta = paged_batch([5], [1], (2, 2), 64, 16, torch.float32)
    with pytest.raises(ValueError, match="fp32 CPU"):
        attention_cpu.paged_decode_attention_cpu(
            q.double(), k_cache, v_cache, meta.block_tables, meta.seq_lens_tensor, 0.125
        )


def test_without_a_compiler_nothing_is_built_and_torch_is_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:  # noqa: ANN001 - pytest's tmp_path
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("CADENZA_CACHE_DIR", str(tmp_path))
    build.load.cache_clear()
    host_backend.cache_clear()
    try:
        assert build.load("decode_attention") is None
        assert not attention_cpu.decode_attention_available()
        assert ops.default_backend() == ("triton" if torch.cuda.is_available() else "torch")
        assert not list(tmp_path.iterdir())
    finally:
        monkeypatch.undo()
        build.load.cache_clear()
        host_backend.cache_clear()
    assert attention_cpu.decode_attention_available()


def test_a_fresh_cache_builds_the_library_once(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setenv("CADENZA_CACHE_DIR", str(tmp_path))
    build.load.cache_clear()
    try:
        assert build.load("decode_attention") is not None
        built = sorted(p.name for p in tmp_path.iterdir())
        assert len(built) == 1 and built[0].startswith("decode_attention-") and built[0].endswith(".so")
        build.load.cache_clear()
        assert build.load("decode_attention") is not None
        assert sorted(p.name for p in tmp_path.iterdir()) == built  # reused, not rebuilt
    finally:
        monkeypatch.undo()
        build.load.cache_clear()


@pytest.mark.parametrize("rows", [1, 3, 40])  # 40: past PARALLEL_ROWS, so the threaded loop
def test_norm_rotary_and_silu_match_the_references(rows: int) -> None:
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 576), torch.randn(rows, 576), torch.rand(576) + 0.5
    out, summed = elementwise.fused_add_rms_norm_cpu(x, residual, weight, 1e-5)
    ref_out, ref_summed = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        elementwise.fused_add_rms_norm_cpu(x, None, weight, 1e-5)[0], rms_norm_ref(x, weight, 1e-5)
    )

    qkv = torch.randn(rows, (9 + 3 + 3) * 64)  # q and k are strided views of the fused output
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(rows, 9, 64), k.view(rows, 3, 64)
    cos_sin = torch.randn(rows, 64)
    for got, expected in zip(elementwise.rotary_cpu(q, k, cos_sin), rotary_ref(q, k, cos_sin), strict=True):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)

    gate_up = torch.randn(rows, 2 * 1536) * 4
    torch.testing.assert_close(elementwise.silu_and_mul_cpu(gate_up), silu_and_mul_ref(gate_up), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize(("out_features", "bias"), [(576, False), (963, True)])  # 963: not a multiple of 4
@pytest.mark.parametrize("in_features", [576, 1536, 13, 100])  # 13, 100: the 32/16/8-wide loops' tails
def test_the_few_rows_gemv_matches_a_matmul(rows: int, out_features: int, bias: bool, in_features: int) -> None:
    torch.manual_seed(out_features + rows + in_features)
    x, weight = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    b = torch.randn(out_features) if bias else None
    expected = torch.nn.functional.linear(x, weight, b)
    # Outputs are ~sqrt(in_features) in size; the kernel sums in a different order than MKL.
    atol = 2e-6 * in_features**0.5
    torch.testing.assert_close(gemv.linear_few_rows(x, weight, b), expected, atol=atol, rtol=1e-5)


def test_no_pointer_is_taken_from_a_temporary() -> None:
    """`t.contiguous().data_ptr()` inline: when contiguous() copies, the copy has no name and
    may be freed before the C function reads it. Every pointer must come from a bound tensor."""
    import ast
    import inspect

    for module in (bindings, elementwise, gemv, decode_stack, attention_cpu):
        tree = ast.parse(inspect.getsource(module))
        temporaries = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "data_ptr"
            and isinstance(node.func.value, ast.Call)
        ]
        assert not temporaries, f"data_ptr() of a temporary at lines {temporaries} of {module.__name__}"


def test_strided_inputs_give_the_contiguous_answer() -> None:
    """Transposed (non-contiguous) residual and weight views are copied and kept alive for the call."""
    torch.manual_seed(7)
    x = torch.randn(5, 576)
    residual = torch.randn(576, 5).t()  # a view whose contiguous() copies
    weight = (torch.rand(2, 576) + 0.5)[0]
    weight_strided = torch.stack([weight, weight], dim=1)[:, 0]
    assert not residual.is_contiguous() and not weight_strided.is_contiguous()
    out, summed = elementwise.fused_add_rms_norm_cpu(x, residual, weight_strided, 1e-5)
    ref_out, ref_summed = fused_add_rms_norm_ref(x, residual.contiguous(), weight, 1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
