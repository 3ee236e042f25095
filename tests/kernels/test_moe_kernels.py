"""The mixture-of-experts kernels against their torch reference: routing, the expert-sorted
block layout, the fused Triton kernel (interpreted on the CPU) and the grouped path in every
weight format, with expert parallelism's shares summing to the whole."""

from __future__ import annotations

import pytest
import torch
from cadenza_testkit.kernel_compare import DEVICE, DTYPES, within_2x

from cadenza.kernels.linear import choose_linear_method
from cadenza.kernels.linear.dense import DenseLinear
from cadenza.kernels.moe.batched import BatchedExperts
from cadenza.kernels.moe.choose import choose_experts
from cadenza.kernels.moe.grouped import GroupedExperts
from cadenza.kernels.moe.routing import route_top_k
from cadenza.kernels.moe.triton_fused import BLOCK_M, align_blocks, fused_moe_ref, fused_moe_triton
from cadenza.kernels.ops import BUNDLES
from cadenza.kernels.quant.dequantize import dequantize
from cadenza.kernels.quant.quantize import quantize, to_dense_kind

HIDDEN, INTER = 64, 96
PACK = {
    "bf16": lambda w: to_dense_kind(w, "bf16"),
    "int8": lambda w: quantize(w, "int8", 0),
    "int4": lambda w: quantize(w, "int4", 32),
}


def _layer(experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's two fused weights as the model stores them: [in, out] with experts stacked
    along out (w13^T, w2^T), returned as the kernels' [E, N, K] strided views."""
    g = torch.Generator().manual_seed(seed)
    w13_t = torch.randn(HIDDEN, experts * 2 * INTER, generator=g) * 0.1
    w2_t = torch.randn(INTER, experts * HIDDEN, generator=g) * 0.1
    return w13_t.t().view(experts, 2 * INTER, HIDDEN), w2_t.t().view(experts, HIDDEN, INTER)


def _routing(tokens: int, experts: int, top_k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    return route_top_k(logits, top_k, renormalize=True)


def test_routing_is_softmax_top_k_with_or_without_renormalisation() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    weights, ids = route_top_k(logits, 2, renormalize=False)
    assert ids.tolist() == [[0, 2]] and torch.allclose(weights[0], probs[[0, 2]])
    weights, _ = route_top_k(logits, 2, renormalize=True)
    assert torch.allclose(weights[0], probs[[0, 2]] / probs[[0, 2]].sum())


@pytest.mark.parametrize("tokens,experts", [(1, 4), (7, 8), (40, 8)])
def test_blocks_hold_every_pair_once_and_one_expert_each(tokens: int, experts: int) -> None:
    _, ids = _routing(tokens, experts, 2)
    rows, block_expert = align_blocks(ids, experts, BLOCK_M)
    assert rows.numel() == block_expert.numel() * BLOCK_M
    real = rows[rows < ids.numel()]
    assert sorted(real.tolist()) == list(range(ids.numel()))  # each (token, slot) pair once
    for block, expert in enumerate(block_expert.tolist()):
        pairs = rows[block * BLOCK_M : (block + 1) * BLOCK_M]
        pairs = pairs[pairs < ids.numel()]
        assert (ids.flatten()[pairs] == expert).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,top_k", [(1, 4, 2), (9, 8, 2), (33, 4, 3)])
def test_fused_triton_kernel_matches_the_reference(dtype: torch.dtype, tokens: int, experts: int, top_k: int) -> None:
    w13, w2 = _layer(experts)
    weights, ids = _routing(tokens, experts, top_k)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(2))
    exact = fused_moe_ref(x, w13, w2, weights, ids)
    on = dict(device=DEVICE, dtype=dtype)
    args = (x.to(**on), w13.to(**on), w2.to(**on), weights.to(DEVICE), ids.to(DEVICE))
    within_2x(fused_moe_triton(*args).cpu(), fused_moe_ref(*args).cpu(), exact)


def _grouped(
    w13: torch.Tensor, w2: torch.Tensor, kind: str, first: int = 0, local: int | None = None
) -> GroupedExperts:
    """The grouped path over the two fused weights packed in `kind` ("dense": as loaded),
    holding experts [first, first + local) as expert parallelism would."""
    experts = w13.shape[0]
    local = experts - first if local is None else local
    mine13, mine2 = w13[first : first + local].reshape(-1, HIDDEN), w2[first : first + local].reshape(-1, INTER)
    if kind == "dense":
        gate_up, down = DenseLinear(mine13.t()), DenseLinear(mine2.t())
    else:
        gate_up, down = choose_linear_method([PACK[kind](mine13)]), choose_linear_method([PACK[kind](mine2)])
    rows13, rows2 = 2 * INTER, HIDDEN
    return GroupedExperts(
        [gate_up.row_slice(e * rows13, (e + 1) * rows13) for e in range(local)],
        [down.row_slice(e * rows2, (e + 1) * rows2) for e in range(local)],
        experts,
        first,
        BUNDLES["cpu"].silu_and_mul,
    )


def _as_stored(w13: torch.Tensor, w2: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights as the format stores them, decoded: what the grouped path must reproduce."""
    if kind == "dense":
        return w13, w2

    def decode(w: torch.Tensor) -> torch.Tensor:
        return dequantize(PACK[kind](w.reshape(-1, w.shape[2]))).float().view(w.shape)

    return decode(w13), decode(w2)


@pytest.mark.parametrize("kind", ["dense", "bf16", "int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 3, 20])
def test_grouped_path_reads_each_experts_rows_in_every_format(kind: str, tokens: int) -> None:
    w13, w2 = _layer(8)
    weights, ids = _routing(tokens, 8, 2)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    expected = fused_moe_ref(x, *_as_stored(w13, w2, kind), weights, ids)
    torch.testing.assert_close(_grouped(w13, w2, kind)(x, weights, ids), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["dense", "int4"])
def test_expert_parallel_shares_sum_to_the_whole_layer(kind: str) -> None:
    """Two ranks holding experts 0-3 and 4-7 each add only their experts' part: the sum the
    all-reduce forms is the whole layer's output."""
    w13, w2 = _layer(8)
    weights, ids = _routing(12, 8, 2)
    x = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(4))
    whole = _grouped(w13, w2, kind)(x, weights, ids)
    shares = [_grouped(w13, w2, kind, first, 4)(x, weights, ids) for first in (0, 4)]
    assert not torch.allclose(shares[0], whole)
    torch.testing.assert_close(shares[0] + shares[1], whole, rtol=1e-5, atol=1e-5)


def test_a_decode_step_reads_only_its_experts() -> None:
    """One token, top-2 of 8: the other six experts' methods are never called."""
    w13, w2 = _layer(8)
    experts = _grouped(w13, w2, "dense")
    called: list[int] = []
    for index, method in enumerate(experts.gate_up):
        apply = method.apply

        def spy(x: torch.Tensor, bias: torch.Tensor | None, index: int = index, apply=apply) -> torch.Tensor:  # noqa: ANN001
            called.append(index)
            return apply(x, bias)

        method.apply = spy
    weights, ids = _routing(1, 8, 2)
    experts(torch.randn(1, HIDDEN), weights, ids)
    assert sorted(called) == sorted(ids[0].tolist())


@pytest.mark.parametrize("kind,gemm_dtype", [("f32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("first,local", [(0, 8), (4, 4)])
def test_batched_path_past_the_few_row_size_matches_the_reference(
    kind: str, gemm_dtype: torch.dtype, first: int, local: int
) -> None:
    """Where the experts are stored dense in the GEMM dtype, a 40-token step runs them as two
    padded bmm (this rank's experts only, under expert parallelism); a 3-token step keeps the
    exact grouped path."""
    w13, w2 = _layer(8)
    mine13, mine2 = w13[first : first + local].reshape(-1, HIDDEN), w2[first : first + local].reshape(-1, INTER)
    store = (lambda w: to_dense_kind(w, "bf16")) if kind == "bf16" else (lambda w: to_dense_kind(w, "f32"))
    gate_up, down = choose_linear_method([store(mine13)]), choose_linear_method([store(mine2)])
    experts = choose_experts(gate_up, down, 8, first, local, BUNDLES["cpu"], gemm_dtype)
    assert isinstance(experts, BatchedExperts)
    stored13, stored2 = (w13.bfloat16().float(), w2.bfloat16().float()) if kind == "bf16" else (w13, w2)
    for tokens in (40, 3):
        weights, ids = _routing(tokens, 8, 2)
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(6))
        mask = ((ids >= first) & (ids < first + local)).float()  # this rank's share of each token
        expected = fused_moe_ref(x, stored13, stored2, weights * mask, ids)
        tol = 2e-2 if gemm_dtype == torch.bfloat16 and tokens > 16 else 1e-4
        torch.testing.assert_close(experts(x, weights, ids), expected, rtol=tol, atol=tol)
