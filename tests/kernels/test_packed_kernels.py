"""The packed-weight kernels (csrc/packed_linear.c, kernels/linear/packed.py) against the torch
reference (dequantize, then matmul), for every format, shape class and row count; the GGUF
repacking against gguf's own dequantizer; the decode stack over packed layers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from cadenza.format_names import cpu_flags
from cadenza.kernels.cpu.packed import (
    BoundWeight,
    packed_available,
    packed_dequantize,
    packed_gather,
    packed_linear,
    round_activations,
)
from cadenza.kernels.linear import packed as packed_linear_module
from cadenza.kernels.linear.orientation import MAX_CALIBRATED_ROWS, transposed_wins
from cadenza.kernels.linear.packed import PACKED_FEW_ROWS, PackedLinear
from cadenza.kernels.quant.dequantize import dequantize, round_activations_ref
from cadenza.kernels.quant.gguf_blocks import packed_from_gguf
from cadenza.kernels.quant.quantize import quantize_int4, quantize_int8, to_dense_kind
from cadenza.kernels.quant.weight import PackedWeight, cat_rows, ideal_bytes_per_weight

Q = gguf.GGMLQuantizationType
needs_c = pytest.mark.skipif(not packed_available(), reason="no C compiler: the packed kernels cannot be built")
# Shape classes: SmolLM2's qkv (in 576) and down (in 1536), a K-quant width (in 512), odd rows.
# 160 columns: an odd number of 32-blocks (the AVX-512 row kernels take blocks in pairs)
SHAPES = [(40, 576), (24, 1536), (33, 512), (17, 160)]
ROWS = [1, 3, 4, 5, 8, 9, 16, 17, 34, 64, 70, 300]  # 3+: q4's and q8's integer tiles on AVX-512 (300: 2 x chunks)


def _gguf_blocks(type_name: str, rows: int, cols: int, seed: int) -> PackedWeight:
    """Random blocks with sane fp16 scales (random bytes there would be inf / NaN)."""
    rng = np.random.default_rng(seed)
    block, size = gguf.GGML_QUANT_SIZES[getattr(Q, type_name)]
    raw = rng.integers(0, 256, rows * cols // block * size, dtype=np.uint8).reshape(rows, cols // block, size)
    fp16 = lambda v: np.array([v], np.float16).view(np.uint8)  # noqa: E731
    scale_fields = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}[type_name]
    for offset in scale_fields:
        raw[:, :, offset : offset + 2] = fp16(rng.uniform(0.005, 0.02))
    return packed_from_gguf(type_name, raw.reshape(rows, -1), rows, cols)


def _formats(rows: int, cols: int) -> dict[str, PackedWeight]:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols)) * 0.05
    out = {kind: to_dense_kind(w, kind) for kind in ("f32", "bf16", "f16")}
    out["int8"] = quantize_int8(w)
    for group in (32, 64, 128):
        if cols % group == 0:
            out[f"int4-g{group}"] = quantize_int4(w, group)
    for type_name in ("Q8_0", "Q4_0", "Q4_1"):
        out[type_name] = _gguf_blocks(type_name, rows, cols, rows)
    if cols % 256 == 0:
        out["Q4_K"], out["Q6_K"] = _gguf_blocks("Q4_K", rows, cols, 1), _gguf_blocks("Q6_K", rows, cols, 2)
    return out


CASES = [(shape, name) for shape in SHAPES for name in _formats(*shape)]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K", "F16", "BF16"])
def test_gguf_repacking_decodes_as_gguf_does(type_name: str) -> None:
    rows, cols = 6, 512
    if type_name in ("F16", "BF16"):
        values = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(values, getattr(Q, type_name))
        packed = packed_from_gguf(type_name, raw, rows, cols)
    else:
        packed = _gguf_blocks(type_name, rows, cols, 0)
        raw = None
    # The reference: gguf's numpy dequantizer on the very bytes (re-joined for the split types).
    expected = gguf.quants.dequantize(raw if raw is not None else _rejoin(packed, type_name), getattr(Q, type_name))
    torch.testing.assert_close(dequantize(packed), torch.from_numpy(expected.reshape(rows, cols)), rtol=0, atol=0)


def _rejoin(w: PackedWeight, type_name: str) -> np.ndarray:
    """A split PackedWeight's blocks back in GGUF's interleaved layout."""
    if type_name in ("Q4_K", "Q6_K"):
        return w.data.numpy()
    groups = w.cols // 32
    fields = [w.scales.half().view(torch.uint8).view(w.rows, groups, 2)]
    if w.mins is not None:
        fields.append(w.mins.view(torch.uint8).view(w.rows, groups, 2))
    codes = w.data.view(torch.uint8).view(w.rows, groups, -1)
    return torch.cat([*fields, codes], dim=2).reshape(w.rows, -1).numpy()


def _expected(
    w: PackedWeight, x: torch.Tensor, reference: torch.Tensor, bias: torch.Tensor, round_x: bool
) -> torch.Tensor:
    """Dequantize, then matmul; with int8 activations, x rounded as the q4 / q8 kernels read it."""
    return (round_activations_ref(x) if round_x and w.can_round_activations else x) @ reference.T + bias


@needs_c
@pytest.mark.parametrize("round_x", [False, True], ids=["exact", "int8-activations"])
@pytest.mark.parametrize(("shape", "name"), CASES, ids=[f"{s[0]}x{s[1]}-{n}" for s, n in CASES])
def test_the_c_kernel_matches_dequantize_then_matmul(shape: tuple[int, int], name: str, round_x: bool) -> None:
    w = _formats(*shape)[name]
    bound, reference, method = BoundWeight(w, round_x), dequantize(w), PackedLinear(w, int8_activations=round_x)
    bias = torch.randn(w.rows)
    for rows in ROWS:
        x = torch.randn(rows, w.cols, generator=torch.Generator().manual_seed(rows))
        expected, tol = _expected(w, x, reference, bias, round_x), 1e-4 * (1 + x.abs() @ reference.abs().T)
        assert ((packed_linear(bound, x, bias) - expected).abs() <= tol).all(), f"{rows} rows"
        assert ((method.apply(x, bias) - expected).abs() <= tol).all(), f"{rows} rows, the method"
        assert ((packed_linear(bound, x, None) - (expected - bias)).abs() <= tol).all(), f"{rows} rows, no bias"
    assert torch.equal(packed_dequantize(bound, 3, 11), reference[3:11])
    # bf16 tiles round as torch does: the C and torch backends multiply the same tiles
    assert torch.equal(packed_dequantize(bound, 3, 11, torch.bfloat16), reference[3:11].bfloat16())
    ids = torch.tensor([5, 0, w.rows - 1, 5])
    assert torch.equal(packed_gather(bound, ids), reference[ids])


@pytest.mark.parametrize("round_x", [False, True], ids=["exact", "int8-activations"])
@pytest.mark.parametrize("rows", [1, PACKED_FEW_ROWS + 1])
def test_the_torch_backend_runs_the_reference(monkeypatch: pytest.MonkeyPatch, rows: int, round_x: bool) -> None:
    monkeypatch.setenv("CADENZA_KERNELS", "torch")
    w = quantize_int4(torch.randn(20, 64), 32)
    x = torch.randn(rows, 64)
    method = PackedLinear(w, int8_activations=round_x)
    expected = (round_activations_ref(x) if round_x else x) @ dequantize(w).T
    torch.testing.assert_close(method.apply(x, None), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(method.gather_rows(torch.tensor([3, 1])), dequantize(w)[[3, 1]])


@pytest.mark.parametrize("name", ["Q4_1", "int8", "bf16", "f32"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_bf16_gemms_round_x_and_the_tiles_to_bf16(monkeypatch: pytest.MonkeyPatch, name: str, backend: str) -> None:
    """gemm_dtype bf16: past the few-row kernel, y = bf16(x) @ bf16(W).T, back in fp32; at or
    under it the fp32 kernel, untouched. A tile larger than TILE_ELEMENTS splits W's rows."""
    if backend == "cpu" and not packed_available():
        pytest.skip("no C compiler: the packed kernels cannot be built")
    monkeypatch.setenv("CADENZA_KERNELS", backend)
    monkeypatch.setattr(packed_linear_module, "TILE_ELEMENTS", 16 * 576)  # 40 rows: three tiles
    w = _formats(40, 576)[name]
    method, dense, bias = PackedLinear(w, gemm_dtype=torch.bfloat16), dequantize(w), torch.randn(w.rows)
    x = torch.randn(PACKED_FEW_ROWS + 5, w.cols, generator=torch.Generator().manual_seed(7))
    got = method.apply(x, bias)
    expected = (x.bfloat16() @ dense.bfloat16().T).float() + bias
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-2, atol=1e-2)
    assert (got - (x @ dense.T + bias)).abs().max() > 0  # bf16, not the fp32 path
    few = x[:PACKED_FEW_ROWS]
    torch.testing.assert_close(method.apply(few, None), few @ dense.T, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("transposed", [False, True], ids=["x@W.T", "(W@x.T).T"])
def test_both_gemm_forms_give_the_tiled_product(monkeypatch: pytest.MonkeyPatch, transposed: bool) -> None:
    """Past the few-row kernel the tiles go through the BLAS in whichever form the race picked
    (kernels/linear/orientation.py): both are x @ W.T, over several tiles."""
    monkeypatch.setattr(packed_linear_module, "TILE_ELEMENTS", 16 * 576)  # 40 rows: three tiles
    monkeypatch.setattr(packed_linear_module, "transposed_wins", lambda rows, dtype: transposed)
    w = _formats(40, 576)["Q4_1"]
    method, dense, bias = PackedLinear(w), dequantize(w), torch.randn(w.rows)
    x = torch.randn(PACKED_FEW_ROWS + 9, w.cols, generator=torch.Generator().manual_seed(3))
    got = method.apply(x, bias)
    assert got.is_contiguous()
    torch.testing.assert_close(got, x @ dense.T + bias, rtol=1e-5, atol=1e-5)


@needs_c
def test_q4_and_q8_with_int8_activations_take_whole_batches_on_avx512() -> None:
    """The C kernel says how many rows its fused path takes (asked once, at bind time): on
    AVX-512 the tiled integer path takes any batch, prefill included; q8's needs VNNI (without
    it the 16-bit pair sums of x + 128 would saturate)."""
    q4, q8 = _formats(40, 576)["Q4_1"], _formats(40, 576)["Q8_0"]
    avx512, every = {"avx512f", "avx512bw"} <= cpu_flags(), 1 << 40
    assert BoundWeight(q4, True).fused_rows == (every if avx512 else 8)
    assert BoundWeight(q8, True).fused_rows == (every if avx512 and "avx512_vnni" in cpu_flags() else 8)
    assert BoundWeight(q4, False).fused_rows == BoundWeight(q8, False).fused_rows == 8
    assert PackedLinear(q4, int8_activations=True).c_rows == (every if avx512 else PACKED_FEW_ROWS)


def test_the_gemm_form_race_answers_per_bucket() -> None:
    assert isinstance(transposed_wins(32, torch.float32), bool)
    assert transposed_wins(32, torch.float32) == transposed_wins(17, torch.float32)  # one bucket, one race
    assert transposed_wins(MAX_CALIBRATED_ROWS + 1, torch.float32) is False  # prefill: the plain form


def test_quantizers_round_trip_within_half_a_step() -> None:
    w = torch.randn(16, 256)
    q8 = quantize_int8(w)
    assert (dequantize(q8) - w).abs().max() <= q8.scales.max() / 2 + 1e-6
    q4 = quantize_int4(w, 64)
    step = q4.scales.float().repeat_interleave(64, dim=1)
    assert ((dequantize(q4) - w).abs() <= step / 2 + 1e-2 * step).all()


def test_rows_and_columns_slice_and_stack_like_the_dense_weight() -> None:
    w = torch.randn(12, 128)
    for packed in (quantize_int8(w), quantize_int4(w, 32), to_dense_kind(w, "bf16")):
        full = dequantize(packed)
        assert torch.equal(dequantize(packed.select_rows([(0, 3), (8, 12)])), torch.cat([full[:3], full[8:]]))
        assert torch.equal(dequantize(packed.narrow_cols(64, 128)), full[:, 64:])
        assert torch.equal(dequantize(cat_rows([packed, packed])), torch.cat([full, full]))
    with pytest.raises(ValueError, match="multiples of 32"):
        quantize_int4(w, 32).narrow_cols(0, 48)


@needs_c
@pytest.mark.parametrize("round_x", [False, True], ids=["exact", "int8-activations"])
@pytest.mark.parametrize("rows", [1, 8, 9, 16, 17, 40])
def test_a_row_gets_the_same_result_in_any_batch(rows: int, round_x: bool) -> None:
    """The fused path (<= 8 rows), the decode-row path and the BLAS tiles compute one function
    (with int8 activations, of the same rounded x): a row's output does not depend on its batch."""
    method = PackedLinear(_gguf_blocks("Q4_1", 64, 576, 3), int8_activations=round_x)
    x = torch.randn(rows, 576)
    torch.testing.assert_close(method.apply(x, None)[:1], method.apply(x[:1], None), rtol=1e-5, atol=1e-5)


def test_rounded_activations_match_the_reference() -> None:
    x = torch.randn(5, 96) * torch.logspace(-3, 2, 96)
    assert torch.equal(round_activations(x), round_activations_ref(x))
    assert (round_activations_ref(x) - x).abs().max() <= x.abs().max() / 254


def test_ideal_sizes() -> None:
    w = torch.randn(8, 256)
    assert ideal_bytes_per_weight(quantize_int4(w, 64)) == 0.5625
    assert ideal_bytes_per_weight(_gguf_blocks("Q6_K", 8, 256, 0)) == 210 / 256
    assert ideal_bytes_per_weight(to_dense_kind(w, "bf16")) == 2
