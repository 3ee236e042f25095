"""Triton kernels against their torch references, run by the Triton interpreter on the CPU.

Numerical ops: the kernel's error against an fp32 reference stays within 2x the torch
reference's own error in the same dtype (plus a floor for exact fp32 ties). KV write: exact.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from cadenza_testkit.kernel_compare import DEVICE, DTYPES, within_2x

from cadenza.kernels.activation import silu_and_mul_ref
from cadenza.kernels.attention import triton_paged
from cadenza.kernels.kv_write import write_kv_ref
from cadenza.kernels.norm import fused_add_rms_norm_ref, rms_norm_ref
from cadenza.kernels.rotary import rotary_ref
from cadenza.kernels.triton_elementwise import (
    fused_add_rms_norm_triton,
    rotary_triton,
    silu_and_mul_triton,
    write_kv_triton,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "hidden"), [(1, 64), (7, 576), (33, 1000)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_fused_add_rms_norm(dtype: torch.dtype, rows: int, hidden: int, with_residual: bool) -> None:
    torch.manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, device=DEVICE).to(dtype)
    residual = torch.randn(rows, hidden, device=DEVICE).to(dtype) if with_residual else None
    weight = (torch.rand(hidden, device=DEVICE) + 0.5).to(dtype)
    out, res_out = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    if with_residual:
        ref, ref_res = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
        exact, _ = fused_add_rms_norm_ref(x.float(), residual.float(), weight.float(), 1e-5)
        assert torch.equal(res_out, ref_res)  # the residual stream is the same rounded sum
    else:
        ref, exact = rms_norm_ref(x, weight, 1e-5), rms_norm_ref(x.float(), weight.float(), 1e-5)
    within_2x(out, ref, exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "inter"), [(1, 96), (5, 1536), (17, 1000)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, inter: int) -> None:
    x = torch.randn(rows, 2 * inter, device=DEVICE).to(dtype)
    within_2x(silu_and_mul_triton(x), silu_and_mul_ref(x), silu_and_mul_ref(x.float()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 64), (9, 3, 64), (8, 2, 128), (8, 1, 128)])
@pytest.mark.parametrize("tokens", [1, 13])
def test_rotary_on_strided_qkv_views(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, tokens: int) -> None:
    """q and k are views into the fused qkv projection output, as in the model."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2, device=DEVICE) * 100
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
    got, ref, exact = rotary_triton(q, k, cos_sin), rotary_ref(q, k, cos_sin), rotary_ref(q.float(), k.float(), cos_sin)
    for g, r, e in zip(got, ref, exact, strict=True):
        within_2x(g, r, e)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(1, 64), (2, 64), (8, 128)])
def test_write_kv_is_exact(dtype: torch.dtype, block_size: int, kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(block_size + kv_heads)
    num_blocks, tokens = 6, 37  # ends mid-block, spans several blocks
    fused = torch.randn(tokens, 3 * kv_heads * head_dim, device=DEVICE).to(dtype)
    _, key, value = fused.split(kv_heads * head_dim, dim=-1)  # strided, as sliced from qkv
    key, value = key.view(tokens, kv_heads, head_dim), value.view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    caches = [torch.zeros(num_blocks, block_size, kv_heads, head_dim, device=DEVICE, dtype=dtype) for _ in range(4)]
    write_kv_ref(key, value, caches[0], caches[1], slots)
    write_kv_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def _counted(counts: dict[str, int], name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn, counting its calls under counts[name]."""

    def wrapper(*args: object, **kwargs: object) -> torch.Tensor:
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


def test_model_greedy_tokens_equal_with_triton_kernels(tiny_model, monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch mixing a chunked prefill, a prefix-cache hit and decodes, both backends; on
    triton, attention runs both the decode and the extend kernel."""
    from cadenza import LLM, SamplingParams

    launches = {"decode": 0, "extend": 0}
    for name, attr in (("decode", "paged_decode_attention_triton"), ("extend", "extend_attention_triton")):
        monkeypatch.setattr(triton_paged, attr, _counted(launches, name, getattr(triton_paged, attr)))

    path, _ = tiny_model("llama_gqa_tied")
    shared = [(5 * i) % 150 + 3 for i in range(40)]
    prompts = [shared + [7, 8, 9], shared + [10, 11], list(range(20, 31))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    def run(kernels: str) -> tuple[list[list[int]], int]:
        monkeypatch.setenv("CADENZA_KERNELS", kernels)
        llm = LLM(str(path), num_blocks=64, block_size=8, max_num_batched_tokens=24)
        llm.generate({"prompt_token_ids": shared + [1]}, params, use_tqdm=False)  # warms the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs)

    torch_tokens, torch_hits = run("torch")
    assert launches == {"decode": 0, "extend": 0}
    triton_tokens, triton_hits = run("triton")
    assert launches["decode"] > 0 and launches["extend"] > 0
    assert triton_tokens == torch_tokens
    assert torch_hits == triton_hits >= 40  # the shared prefix came from the cache
