"""The Triton GEMMs over packed q8 / q4 weights against the dequantizing references: on-load
int8 / int4 and GGUF's Q8_0 / Q4_0 / Q4_1 blocks (as gguf's own quantizer writes them)."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch
from cadenza_testkit.kernel_compare import DEVICE, within_2x

from cadenza.kernels import ops
from cadenza.kernels.linear.triton_packed import TritonPackedLinear
from cadenza.kernels.quant.dequantize import dequantize, packed_matmul_ref
from cadenza.kernels.quant.gguf_blocks import packed_from_gguf
from cadenza.kernels.quant.quantize import quantize_int4, quantize_int8, to_dense_kind
from cadenza.kernels.quant.triton_gemm import packed_matmul_triton
from cadenza.kernels.quant.weight import PackedWeight

N = 40  # not a multiple of the N tile: the last tile is masked


def _dense(k: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(N, k) * 0.05


def _gguf(type_name: str, k: int) -> PackedWeight:
    """gguf's own blocks, split; the split dequantizes exactly as gguf itself does."""
    raw = gguf.quants.quantize(_dense(k, k).numpy(), gguf.GGMLQuantizationType[type_name])
    w = packed_from_gguf(type_name, raw, N, k)
    expected = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name]).astype(np.float32)
    torch.testing.assert_close(dequantize(w), torch.from_numpy(expected), rtol=0, atol=0)
    return w


# name -> the weight (K is not a power of two wherever the group allows it).
WEIGHTS: dict[str, Callable[[], PackedWeight]] = {
    "q8_per_channel": lambda: quantize_int8(_dense(200, 1)),
    "q8_0": lambda: _gguf("Q8_0", 576),
    "q4_g32": lambda: quantize_int4(_dense(576, 2), 32),
    "q4_g64": lambda: quantize_int4(_dense(192, 3), 64),
    "q4_g128": lambda: quantize_int4(_dense(384, 4), 128),
    "q4_0": lambda: _gguf("Q4_0", 160),
    "q4_1": lambda: _gguf("Q4_1", 224),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("m", "bias"), [(1, False), (5, True), (33, False), (33, True)])
@pytest.mark.parametrize("name", WEIGHTS)
def test_packed_matmul(name: str, m: int, bias: bool, dtype: torch.dtype) -> None:
    w = WEIGHTS[name]().to(DEVICE)
    torch.manual_seed(m)
    x = torch.randn(m, w.cols, device=DEVICE).to(dtype)
    b = torch.randn(w.rows, device=DEVICE).to(dtype) if bias else None
    exact = x.float() @ dequantize(w).T + (0 if b is None else b.float())
    got = packed_matmul_triton(x, w, b)
    assert got.shape == (m, w.rows) and got.dtype == dtype
    within_2x(got, packed_matmul_ref(x, w, b), exact)


@pytest.mark.parametrize("name", ["q8_per_channel", "q8_0", "q4_g64"])
def test_tensor_parallel_slices(name: str) -> None:
    """Rows selected and columns narrowed read alike (the grouped kinds; a per-channel q8 is
    only row-selected here)."""
    part = WEIGHTS[name]().select_rows([(3, 20), (30, 37)])
    if part.group != part.cols:
        part = part.narrow_cols(part.group, part.cols - part.group)
    part = part.to(DEVICE)
    x = torch.randn(5, part.cols, device=DEVICE)
    exact = x @ dequantize(part).T
    within_2x(packed_matmul_triton(x, part, None), packed_matmul_ref(x, part, None), exact)


def test_q4_nibble_order_is_ggufs() -> None:
    """One nonzero code per row, in byte r of row r: element j of a sub-block is byte j's low
    nibble, element j + 16 its high nibble; with x_k = k the output is the element's index."""
    k, rows = 64, 32
    data = torch.zeros(rows, k // 2, dtype=torch.uint8)
    for r in range(rows):
        data[r, r] = 1 if r % 2 else 0x10  # odd rows the low nibble, even rows the high
    ones = torch.ones(rows, k // 32, dtype=torch.float16)
    w = PackedWeight("q4", rows, k, data, group=32, scales=ones, mins=torch.zeros_like(ones)).to(DEVICE)
    x = torch.arange(k, dtype=torch.float32, device=DEVICE)[None, :]
    expected = [32 * (r // 16) + r % 16 + (0 if r % 2 else 16) for r in range(rows)]
    got = packed_matmul_triton(x, w, None)
    assert got[0].tolist() == expected == packed_matmul_ref(x, w, None)[0].tolist()


def test_other_kinds_are_refused_by_name() -> None:
    w = to_dense_kind(torch.randn(N, 64), "f16")
    with pytest.raises(ValueError, match="'f16'"):
        packed_matmul_triton(torch.randn(2, 64), w, None)


def test_ops_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both backends through ops, on a 3-D activation (batch x tokens x K)."""
    x = torch.randn(2, 3, 128, device=DEVICE)
    w8, w4 = quantize_int8(_dense(128, 5)).to(DEVICE), quantize_int4(_dense(128, 6), 64).to(DEVICE)
    bias = torch.randn(N, device=DEVICE)
    results = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("CADENZA_KERNELS", name)
        kernels = ops.bind_kernels(x.device)  # the backend is read when bound, as for a model
        assert kernels.backend == name
        results[name] = kernels.packed_matmul(x, w8, None), kernels.packed_matmul(x, w4, bias)
    for ref, got in zip(results["torch"], results["triton"], strict=True):
        assert got.shape == (2, 3, N)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_triton_packed_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENZA_KERNELS", "triton")  # read when the method is built
    w = quantize_int4(_dense(96, 7), 32).to(DEVICE)
    method = TritonPackedLinear(w)
    assert method.packed() is w and method.weight_bytes() == w.nbytes == N * 48 + 2 * N * 3 * 2
    x, bias = torch.randn(3, 96, device=DEVICE), torch.randn(N, device=DEVICE)
    torch.testing.assert_close(method.apply(x, bias), packed_matmul_ref(x, w, bias), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="'q4_k'"):
        TritonPackedLinear(PackedWeight("q4_k", N, 256, torch.zeros(N, 144, dtype=torch.uint8), group=256))
