"""The machine figures every benchmark prints beside its own: GEMM rate and read bandwidth."""

from __future__ import annotations

import math

import pytest
import torch

from cadenza.benchmarks import offline


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per torch.mm the probe runs."""
    seen: list[int] = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda *a, **k: seen.append(1) or real_mm(*a, **k))
    return seen


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_gemm_rate_counts_the_products_it_ran(calls: list[int], dtype: torch.dtype | None) -> None:
    """With a zero budget it stops after one product (plus the warm-up) and rates that one."""
    rate = offline.measure_gemm_gflops(n=64, reps=1000, dtype=dtype, budget_s=0.0)
    assert len(calls) == 2 and math.isfinite(rate) and rate > 0


def test_gemm_rate_runs_all_reps_within_its_budget(calls: list[int]) -> None:
    assert offline.measure_gemm_gflops(n=8, reps=5, budget_s=1e9) > 0
    assert len(calls) == 1 + 5


def test_read_bandwidth_is_positive() -> None:
    assert offline.measure_read_gbps(megabytes=8, reps=2) > 0
