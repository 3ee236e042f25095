"""The GPU check's mixture-of-experts cases: the fused-MoE Triton kernel (kernels/moe) at
decode, batch and prefill token counts, against its torch reference, timed against torch
running each expert's rows as its own matmuls."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cadenza.benchmarks.gpu_cases import Case, Plan

NUM_EXPERTS, TOP_K = 8, 2


def moe_cases(plan: Plan, dtype: torch.dtype, dev: torch.device) -> Iterator[Case]:
    from cadenza.kernels.moe.routing import route_top_k
    from cadenza.kernels.moe.triton_fused import fused_moe_ref, fused_moe_triton

    inter = max(plan.inter // 8, 32)  # an expert's width: a Mixtral-like layer in 1/8 of the memory
    gen = torch.Generator(device=dev).manual_seed(0)
    w13 = torch.randn(NUM_EXPERTS, 2 * inter, plan.hidden, device=dev, generator=gen).to(dtype) * 0.02
    w2 = torch.randn(NUM_EXPERTS, plan.hidden, inter, device=dev, generator=gen).to(dtype) * 0.02
    size = torch.finfo(dtype).bits // 8
    for tokens in sorted({1, *plan.rows}):
        x = torch.randn(tokens, plan.hidden, device=dev, generator=gen).to(dtype)
        weights, ids = route_top_k(torch.randn(tokens, NUM_EXPERTS, device=dev, generator=gen), TOP_K, True)
        read = min(NUM_EXPERTS, tokens * TOP_K) * 3 * inter * plan.hidden * size  # experts a step touches
        yield Case(
            kernel="fused_moe",
            shape={"tokens": tokens, "hidden": plan.hidden, "expert_inter": inter, "experts": NUM_EXPERTS},
            run=lambda x=x, w=weights, i=ids: fused_moe_triton(x, w13, w2, w, i),
            ref=lambda x=x, w=weights, i=ids: fused_moe_ref(x, w13, w2, w, i),
            exact=lambda x=x, w=weights, i=ids: fused_moe_ref(x.float(), w13.float(), w2.float(), w, i),
            baseline=lambda x=x, w=weights, i=ids: _per_expert(x, w13, w2, w, i),
            bytes=read,
            flops=2 * tokens * TOP_K * 3 * inter * plan.hidden,
        )


def _per_expert(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> None:
    """What torch would run instead: each expert's rows gathered and multiplied on their own."""
    inter = w2.shape[2]
    for expert in range(w13.shape[0]):
        rows, slot = (ids == expert).nonzero(as_tuple=True)
        if rows.numel():
            h = x[rows] @ w13[expert].T
            y = (torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[expert].T
            y * w[rows, slot, None].to(y.dtype)
