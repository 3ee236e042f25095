"""Weight-only quantized GEMMs (W8A16, W4A16): round trips, and kernels against references."""

from __future__ import annotations

import pytest
import torch

from cadenza.kernels import ops
from cadenza.kernels.quant_gemm import (
    dequantize_w4,
    dequantize_w8,
    quantize_w4,
    quantize_w8,
    w4a16_matmul_ref,
    w4a16_matmul_triton,
    w8a16_matmul_ref,
    w8a16_matmul_triton,
)
from tests.kernels._compare import DEVICE, DTYPES, within_2x


def _weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.randn(n, k, device=DEVICE) * 0.05).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_w8_round_trip(dtype: torch.dtype) -> None:
    weight = _weight(96, 200, dtype)
    weight[3] = 0  # an all-zero row must not divide by zero
    qweight, scales = quantize_w8(weight)
    assert qweight.dtype == torch.int8 and scales.dtype == dtype and scales.shape == (96,)
    error = (dequantize_w8(qweight, scales) - weight.float()).abs()
    # Round to nearest: at most half a step per element (plus the scale's own rounding).
    assert (error <= scales.float()[:, None] * 0.51).all()
    assert (dequantize_w8(qweight, scales)[3] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_w4_round_trip(dtype: torch.dtype, group_size: int) -> None:
    weight = _weight(48, 256, dtype)
    weight[5, :group_size] = 0
    packed, scales, zeros = quantize_w4(weight, group_size)
    assert packed.shape == (48, 128) and packed.dtype == torch.uint8
    assert scales.shape == zeros.shape == (48, 256 // group_size) and zeros.max() <= 15
    deq = dequantize_w4(packed, scales, zeros, group_size)
    step = scales.float().repeat_interleave(group_size, dim=1)
    assert ((deq - weight.float()).abs() <= step * 0.51).all()
    assert (deq[5, :group_size] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize(("k", "n"), [(256, 96), (192, 320)])
def test_w8a16_matmul(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    torch.manual_seed(m + k)
    qweight, scales = quantize_w8(_weight(n, k, dtype))
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    exact = x.float() @ dequantize_w8(qweight, scales).T
    within_2x(w8a16_matmul_triton(x, qweight, scales), w8a16_matmul_ref(x, qweight, scales), exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", [1, 7, 33])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_w4a16_matmul(dtype: torch.dtype, m: int, group_size: int) -> None:
    torch.manual_seed(m + group_size)
    k, n = 2 * 128, 160
    packed, scales, zeros = quantize_w4(_weight(n, k, dtype), group_size)
    x = torch.randn(m, k, device=DEVICE).to(dtype)
    exact = x.float() @ dequantize_w4(packed, scales, zeros, group_size).T
    got = w4a16_matmul_triton(x, packed, scales, zeros, group_size)
    within_2x(got, w4a16_matmul_ref(x, packed, scales, zeros, group_size), exact)


def test_ops_dispatch_quant_gemms(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both backends through ops, on a 3-D activation (batch x tokens x K)."""
    x = torch.randn(2, 3, 128, device=DEVICE)
    weight = _weight(64, 128, torch.float32)
    w8, w4 = quantize_w8(weight), quantize_w4(weight, 64)
    results = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("CADENZA_KERNELS", name)
        results[name] = ops.w8a16_matmul(x, *w8), ops.w4a16_matmul(x, *w4, 64)
    for ref, got in zip(results["torch"], results["triton"], strict=True):
        assert got.shape == (2, 3, 64)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
