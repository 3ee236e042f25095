"""The weight-format seam: which LinearMethod a projection gets, and that each computes x W^T + b."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from cadenza.kernels.cpu.gemv import gemv_available
from cadenza.kernels.linear import choose_linear_method, cpu_fp32
from cadenza.kernels.linear.cpu_fp32 import CpuFp32Linear
from cadenza.kernels.linear.dense import DenseLinear
from cadenza.models.config import ModelConfig
from cadenza.models.llama import LlamaForCausalLM


def _weight(in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.randn(in_features, out_features, dtype=dtype), requires_grad=False)


def _counting(calls: list[str], name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def wrapper(*args: object) -> torch.Tensor:
        calls.append(name)
        return fn(*args)

    return wrapper


@pytest.mark.skipif(not gemv_available(), reason="no C compiler: the CPU GEMV cannot be built here")
@pytest.mark.parametrize(
    ("rows", "path"), [(1, "gemv"), (8, "gemv"), (9, "dense"), (65, "dense"), (9, "transposed"), (40, "transposed")]
)  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_the_cpu_fp32_method_takes_each_path_and_matches_a_matmul(
    monkeypatch: pytest.MonkeyPatch, rows: int, path: str, bias: bool
) -> None:
    torch.manual_seed(rows)
    weight_t, b, x = _weight(96, 80), (torch.randn(80) if bias else None), torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x, weight_t.detach().t().clone(), b)
    monkeypatch.setenv("CADENZA_KERNELS", "cpu")
    method = choose_linear_method(weight_t)
    assert isinstance(method, CpuFp32Linear)
    calls: list[str] = []
    for name, attr in (("gemv", "linear_few_rows"), ("dense", "dense_linear")):
        monkeypatch.setattr(cpu_fp32, attr, _counting(calls, name, getattr(cpu_fp32, attr)))
    # (W @ x.T).T where the BLAS race says it wins (kernels/linear/orientation.py)
    monkeypatch.setattr(cpu_fp32, "transposed_wins", lambda rows, dtype: path == "transposed")
    torch.testing.assert_close(method.apply(x, b), expected, atol=1e-4, rtol=1e-5)
    assert calls == ([] if path == "transposed" else [path])


def test_the_torch_backend_turns_the_gemv_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CADENZA_KERNELS", "torch")  # read when the method is chosen
    method = choose_linear_method(_weight(32, 16))
    assert isinstance(method, CpuFp32Linear) and not method.few_rows_kernel and method.c_weight() is None
    calls: list[str] = []
    monkeypatch.setattr(cpu_fp32, "linear_few_rows", _counting(calls, "gemv", cpu_fp32.linear_few_rows))
    x = torch.randn(1, 32)
    torch.testing.assert_close(method.apply(x, None), x @ method.weight_t)
    assert calls == []


def test_the_cpu_fp32_method_takes_the_weight_over() -> None:
    """One copy of W: the parameter now views the method's [out, in] rows, same values."""
    weight_t = _weight(48, 24)
    original = weight_t.detach().clone()
    method = choose_linear_method(weight_t)
    rows = method.fp32_rows()
    assert rows is not None and rows.shape == (24, 48) and rows.is_contiguous()
    assert weight_t.data_ptr() == rows.data_ptr() and torch.equal(weight_t, original)
    assert method.weight_bytes() == original.nbytes


@pytest.mark.parametrize(
    "weight_t", [_weight(32, 16, torch.bfloat16), _weight(1, 1)], ids=["bf16", "placeholder"]
)  # fmt: skip
def test_other_weights_stay_dense(weight_t: nn.Parameter) -> None:
    method = choose_linear_method(weight_t)
    assert isinstance(method, DenseLinear) and method.fp32_rows() is None
    assert method.weight_bytes() == weight_t.nbytes
    x = torch.randn(3, weight_t.shape[0], dtype=weight_t.dtype)
    torch.testing.assert_close(method.apply(x, None), x @ weight_t.detach())


@pytest.mark.parametrize("tied", [False, True])
def test_the_models_weight_bytes_do_not_change_when_the_methods_are_chosen(tied: bool) -> None:
    cfg = ModelConfig("LlamaForCausalLM", 160, 64, 96, 2, 4, 2, 16, 1e-5, 10000.0, 512, tied, qkv_bias=True)
    model = LlamaForCausalLM(cfg, 64)
    before = model.weight_bytes()
    model.prepare_kernels()
    assert model.weight_bytes() == before
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert before == params - (model.lm_head.weight_t.nbytes if tied else 0)
