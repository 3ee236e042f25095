"""The GPU check's cases: shapes (Plan), and for each kernel family the inputs, the kernel,
its torch reference and the torch baseline it is timed against (Case). benchmarks/gpu_check
runs and reports them."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

    from cadenza.kernels.quant.weight import PackedWeight

DTYPES = {"bf16": [torch.bfloat16], "fp16": [torch.float16], "both": [torch.bfloat16, torch.float16]}
MAX_DECODE_TOKENS = 1 << 20


@dataclass
class Case:
    """One kernel call at one shape: the kernel, its torch reference, and what to time it against."""

    kernel: str
    shape: dict[str, object]
    run: Callable[[], torch.Tensor]  # the Triton kernel
    ref: Callable[[], torch.Tensor]  # the torch reference in the same dtype
    exact: Callable[[], torch.Tensor] | None  # the fp32 reference; None: run must equal ref bit for bit
    baseline: Callable[[], object]  # what torch would run instead (timed only)
    bench: Callable[[], object] | None = None  # the kernel alone, where run() also reshapes its output
    bytes: int = 0  # memory traffic of one call, for GB/s
    flops: int = 0  # for TFLOP/s
    result: dict[str, object] = field(default_factory=dict)


@dataclass
class Plan:
    """Shapes for one run."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    inter: int = 14336
    block_size: int = 16
    rows: tuple[int, ...] = (1, 256, 4096)  # tokens for the elementwise ops
    handoff_blocks: tuple[int, ...] = (16, 512)  # KV blocks of one hand-over (disaggregation)
    handoff_layers: int = 32
    decode: tuple[tuple[int, int], ...] = ()  # (batch, context)
    prefill: tuple[tuple[int, int, int], ...] = ()  # (requests, query tokens, context) each
    gemm_m: tuple[int, ...] = (1, 16, 64, 256)
    gemm_kn: int = 4096
    group_sizes: tuple[int, ...] = (128,)


def make_plan(tiny: bool, quick: bool) -> Plan:
    if tiny:
        return Plan(
            heads=8,
            kv_heads=2,
            head_dim=64,
            hidden=128,
            inter=96,
            block_size=8,
            rows=(3,),
            decode=((2, 40), (1, 300)),
            prefill=((2, 24, 24), (1, 5, 37)),
            gemm_m=(3,),
            gemm_kn=128,
            group_sizes=(64,),
            handoff_blocks=(5,),
            handoff_layers=2,
        )
    batches, contexts = ((1, 32, 256), (128, 4096, 32768)) if quick else ((1, 8, 64, 256), (128, 1024, 8192, 32768))
    decode = tuple((b, c) for b in batches for c in contexts if b * c <= MAX_DECODE_TOKENS)
    prefill = ((1, 512, 512), (4, 2048, 2048), (1, 8192, 8192), (1, 512, 8192), (64, 5, 2048))
    if quick:
        prefill = ((1, 512, 512), (2, 4096, 4096), (1, 512, 8192), (64, 5, 2048))
    return Plan(
        rows=(1, 4096) if quick else (1, 256, 4096),
        decode=decode,
        prefill=prefill,
        gemm_m=(1, 16, 256) if quick else (1, 16, 64, 256),
        group_sizes=(128,) if quick else (64, 128),
    )


def elementwise_cases(plan: Plan, dtype: torch.dtype, dev: torch.device) -> Iterator[Case]:
    """RMSNorm (fused with the residual add), RoPE, SiLU-and-mul and the KV write."""
    from cadenza.kernels.activation import silu_and_mul_ref
    from cadenza.kernels.norm import fused_add_rms_norm_ref
    from cadenza.kernels.rotary import rotary_ref
    from cadenza.kernels.triton_elementwise import fused_add_rms_norm_triton, rotary_triton, silu_and_mul_triton

    size = torch.finfo(dtype).bits // 8
    for t in plan.rows:
        x, res = (torch.randn(t, plan.hidden, device=dev, dtype=dtype) for _ in range(2))
        w = torch.rand(plan.hidden, device=dev, dtype=dtype) + 0.5
        yield Case(
            kernel="fused_add_rms_norm",
            shape={"tokens": t, "hidden": plan.hidden},
            run=lambda x=x, res=res, w=w: fused_add_rms_norm_triton(x, res, w, 1e-5)[0],
            ref=lambda x=x, res=res, w=w: fused_add_rms_norm_ref(x, res, w, 1e-5)[0],
            exact=lambda x=x, res=res, w=w: fused_add_rms_norm_ref(x.float(), res.float(), w.float(), 1e-5)[0],
            baseline=lambda x=x, res=res, w=w: fused_add_rms_norm_ref(x, res, w, 1e-5),
            bytes=4 * x.numel() * size,
        )
        d, h, k = plan.head_dim, plan.heads, plan.kv_heads
        qkv = torch.randn(t, (h + 2 * k) * d, device=dev, dtype=dtype)
        q, kk = qkv[:, : h * d].view(t, h, d), qkv[:, h * d : (h + k) * d].view(t, k, d)
        angles = torch.rand(t, d // 2, device=dev) * 100
        cs = torch.cat([angles.cos(), angles.sin()], dim=-1)
        yield Case(
            kernel="rotary",
            shape={"tokens": t, "heads": h, "kv_heads": k, "head_dim": d},
            run=lambda q=q, kk=kk, cs=cs: _flat_cat(rotary_triton(q, kk, cs)),
            ref=lambda q=q, kk=kk, cs=cs: _flat_cat(rotary_ref(q, kk, cs)),
            exact=lambda q=q, kk=kk, cs=cs: _flat_cat(rotary_ref(q.float(), kk.float(), cs)),
            baseline=lambda q=q, kk=kk, cs=cs: rotary_ref(q, kk, cs),
            bench=lambda q=q, kk=kk, cs=cs: rotary_triton(q, kk, cs),
            bytes=2 * (h + k) * d * t * size,
        )
        gu = torch.randn(t, 2 * plan.inter, device=dev, dtype=dtype)
        yield Case(
            kernel="silu_and_mul",
            shape={"tokens": t, "intermediate": plan.inter},
            run=lambda gu=gu: silu_and_mul_triton(gu),
            ref=lambda gu=gu: silu_and_mul_ref(gu),
            exact=lambda gu=gu: silu_and_mul_ref(gu.float()),
            baseline=lambda gu=gu: silu_and_mul_ref(gu),
            bytes=3 * gu.numel() // 2 * size,
        )
        yield _kv_write_case(plan, t, dtype, dev)


def _flat_cat(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Several outputs as one [tokens, ...] tensor, so one error covers them all."""
    return torch.cat([t.flatten(1) for t in tensors], dim=1)


def _kv_write_case(plan: Plan, tokens: int, dtype: torch.dtype, dev: torch.device) -> Case:
    from cadenza.kernels.kv_write import write_kv_ref
    from cadenza.kernels.triton_elementwise import write_kv_triton

    k, d, bs = plan.kv_heads, plan.head_dim, plan.block_size
    num_blocks = -(-tokens // bs) * 2
    key, value = (torch.randn(tokens, k, d, device=dev, dtype=dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * bs, device=dev)[:tokens]
    caches = [torch.zeros(num_blocks, bs, k, d, device=dev, dtype=dtype) for _ in range(4)]

    def run(write: Callable[..., None], kc: torch.Tensor, vc: torch.Tensor) -> torch.Tensor:
        write(key, value, kc, vc, slots)
        return torch.cat([kc.flatten(), vc.flatten()])

    return Case(
        kernel="write_kv",
        shape={"tokens": tokens, "kv_heads": k, "head_dim": d, "block_size": bs},
        run=lambda: run(write_kv_triton, caches[0], caches[1]),
        ref=lambda: run(write_kv_ref, caches[2], caches[3]),
        exact=None,
        baseline=lambda: write_kv_ref(key, value, caches[2], caches[3], slots),
        bench=lambda: write_kv_triton(key, value, caches[0], caches[1], slots),
        bytes=4 * key.numel() * key.element_size(),
    )


def paged_batch(
    plan: Plan, seq_lens: list[int], q_lens: list[int], dtype: torch.dtype, dev: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, object]:
    """q, k_cache, v_cache and AttentionMetadata for these requests, on scattered blocks."""
    from cadenza.kernels.attention.metadata import AttentionMetadata

    bs = plan.block_size
    per_req = [-(-n // bs) for n in seq_lens]
    order = torch.randperm(sum(per_req), device=dev) + 1  # block 0 is the table padding
    width, tables, used = max(per_req), [], 0
    for n in per_req:
        row = order[used : used + n]
        tables.append(torch.cat([row, row.new_zeros(width - n)]))
        used += n
    shape = (sum(per_req) + 1, bs, plan.kv_heads, plan.head_dim)
    k_cache, v_cache = (torch.randn(shape, device=dev, dtype=dtype) for _ in range(2))
    q = torch.randn(sum(q_lens), plan.heads, plan.head_dim, device=dev, dtype=dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long, device=dev),
        query_start_loc=qsl,
        seq_lens=seq_lens,
        seq_lens_tensor=torch.tensor(seq_lens, device=dev),
        block_tables=torch.stack(tables),
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),  # the leading 1-token runs
    )
    return q, k_cache, v_cache, meta


def attention_cases(plan: Plan, dtype: torch.dtype, dev: torch.device) -> Iterator[Case]:
    """Decode batches (one context ends mid-block), then prefills, an extend and a verification."""
    h, k, d = plan.heads, plan.kv_heads, plan.head_dim
    size = torch.finfo(dtype).bits // 8
    for batch, ctx in plan.decode:
        seq_lens = [ctx] * batch
        seq_lens[-1] = max(1, ctx - 5)
        case = _attention_case(plan, "decode_attention", seq_lens, [1] * batch, dtype, dev)
        case.shape = {"batch": batch, "context": ctx, "heads": h, "kv_heads": k, "head_dim": d}
        case.bytes = (2 * sum(seq_lens) * k * d + 2 * batch * h * d) * size
        yield case
    for reqs, q_len, ctx in plan.prefill:
        name = "prefill_attention" if q_len == ctx else "extend_attention"
        case = _attention_case(plan, name, [ctx] * reqs, [q_len] * reqs, dtype, dev)
        case.shape = {"requests": reqs, "query_tokens": q_len, "context": ctx, "heads": h, "kv_heads": k, "head_dim": d}
        pairs = reqs * sum(ctx - q_len + i + 1 for i in range(q_len))  # (query, key) pairs under the mask
        case.flops = 4 * pairs * h * d
        yield case


def _attention_case(
    plan: Plan, name: str, seq_lens: list[int], q_lens: list[int], dtype: torch.dtype, dev: torch.device
) -> Case:
    from cadenza.kernels.attention.reference import paged_attention_ref
    from cadenza.kernels.attention.triton_paged import paged_attention_triton

    q, kc, vc, meta = paged_batch(plan, seq_lens, q_lens, dtype, dev)
    scale = plan.head_dim**-0.5
    baseline = _sdpa_baseline(q, kc, vc, meta, q_lens[0], seq_lens[0], scale)
    return Case(
        kernel=name,
        shape={},
        run=lambda: paged_attention_triton(q, kc, vc, meta, scale),
        ref=lambda: paged_attention_ref(q, kc, vc, meta, scale),
        exact=lambda: paged_attention_ref(q.float(), kc.float(), vc.float(), meta, scale),
        baseline=baseline,
    )


def _sdpa_baseline(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: object, q_len: int, ctx: int, scale: float
) -> Callable[[], torch.Tensor]:
    """torch SDPA over contiguous K/V of the first request's length for every request (K/V
    gathered before timing: torch has no paged attention), GQA without repeating K/V."""
    import torch.nn.functional as F

    from cadenza.kernels.attention.reference import gather_kv

    reqs = len(meta.seq_lens)
    keys = torch.stack([gather_kv(kc, meta.block_tables[i], ctx) for i in range(reqs)]).transpose(1, 2)
    values = torch.stack([gather_kv(vc, meta.block_tables[i], ctx) for i in range(reqs)]).transpose(1, 2)
    queries = q.view(reqs, q_len, q.shape[1], q.shape[2]).transpose(1, 2)
    mask = None
    if 1 < q_len < ctx:
        rows = torch.arange(q_len, device=q.device)[:, None] + (ctx - q_len)
        mask = torch.arange(ctx, device=q.device)[None, :] <= rows
    causal = q_len == ctx and q_len > 1
    return lambda: F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True
    )


def gemm_cases(plan: Plan, dtype: torch.dtype, dev: torch.device) -> Iterator[Case]:
    """The packed-weight GEMMs at K = N = plan.gemm_kn: on-load int8 (per channel) and int4
    (per group), and GGUF's Q8_0 / Q4_0 / Q4_1 blocks; torch multiplies by the dequantized
    weight. Each weight is built when its cases are reached, so one is resident at a time."""
    from cadenza.kernels.quant.quantize import quantize_int4, quantize_int8

    weight = torch.randn(plan.gemm_kn, plan.gemm_kn, device=dev) * 0.02
    yield from _packed_cases("w8a16_matmul", {}, quantize_int8(weight), plan.gemm_m, dtype)
    for g in plan.group_sizes:
        yield from _packed_cases("w4a16_matmul", {"group_size": g}, quantize_int4(weight, g), plan.gemm_m, dtype)
    for type_name in GGUF_TYPES:
        yield from _packed_cases("gguf_matmul", {"type": type_name}, gguf_weight(type_name, weight), plan.gemm_m, dtype)


GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1")
# Typical magnitudes of a block's fp16 scale (and Q4_1's min) for weights of std 0.02.
_RANDOM_BLOCK_SCALE = {"Q8_0": 5e-4, "Q4_0": 8e-3, "Q4_1": 4e-3}


def gguf_weight(type_name: str, weight: torch.Tensor) -> PackedWeight:
    """weight [rows, cols] as GGUF blocks of the type (gguf's own quantizer), split into a
    PackedWeight on weight's device; random blocks where this gguf cannot write the type."""
    import numpy as np

    from cadenza.kernels.quant.gguf_blocks import packed_from_gguf

    rows, cols = weight.shape
    try:
        import gguf

        qtype = gguf.GGMLQuantizationType[type_name]
        raw = gguf.quants.quantize(np.ascontiguousarray(weight.float().cpu().numpy()), qtype)
    except (ImportError, AttributeError, KeyError, NotImplementedError):
        raw = random_gguf_blocks(type_name, rows, cols)
    return packed_from_gguf(type_name, raw, rows, cols).to(weight.device)


def random_gguf_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, cols / 32 * block bytes]: random codes under fp16 scales (and mins) of
    weights of std ~0.02, laid out as GGUF's Q8_0 / Q4_0 / Q4_1 blocks."""
    import numpy as np

    rng, n = np.random.default_rng(seed), rows * cols // 32

    def fp16(magnitude: float) -> np.ndarray:
        return (rng.uniform(0.5, 1.5, (n, 1)) * magnitude).astype(np.float16).view(np.uint8)

    scale = _RANDOM_BLOCK_SCALE[type_name]
    if type_name == "Q8_0":
        parts = [fp16(scale), rng.integers(-127, 128, (n, 32), dtype=np.int8).view(np.uint8)]
    else:
        mins = [fp16(-7.5 * scale)] if type_name == "Q4_1" else []
        parts = [fp16(scale), *mins, rng.integers(0, 256, (n, 16), dtype=np.uint8)]
    return np.concatenate(parts, axis=1).reshape(rows, -1)


def _packed_cases(
    kernel: str, shape: dict[str, object], w: PackedWeight, ms: tuple[int, ...], dtype: torch.dtype
) -> Iterator[Case]:
    from cadenza.kernels.quant.dequantize import dequantize, packed_matmul_ref
    from cadenza.kernels.quant.triton_gemm import packed_matmul_triton

    dense = dequantize(w).to(dtype)
    for m in ms:
        x = torch.randn(m, w.cols, device=w.device, dtype=dtype)
        yield Case(
            kernel=kernel,
            shape={"m": m, "k": w.cols, "n": w.rows, **shape},
            run=lambda x=x: packed_matmul_triton(x, w),
            ref=lambda x=x: packed_matmul_ref(x, w),
            exact=lambda x=x: x.float() @ dequantize(w).T,
            baseline=lambda x=x: x @ dense.T,
            bytes=w.nbytes + m * (w.cols + w.rows) * x.element_size(),
            flops=2 * m * w.cols * w.rows,
        )


def kv_handoff_cases(plan: Plan, dtype: torch.dtype, dev: torch.device) -> Iterator[Case]:
    """The KV connector's hand-over of blocks between two engines' caches as a CUDA engine runs
    it (actors/kv_connector/blocks.py): gathered to host numpy, scattered into the other cache
    set. Timed against an on-device copy, what a device transport (NCCL, CUDA IPC) would
    approach."""
    for n in plan.handoff_blocks:
        yield _kv_handoff_case(plan, n, dtype, dev)


def _kv_handoff_case(plan: Plan, n: int, dtype: torch.dtype, dev: torch.device) -> Case:
    from cadenza.actors.kv_connector.blocks import gather_blocks, scatter_blocks

    shape = (2 * n + 1, plan.block_size, plan.kv_heads, plan.head_dim)
    source = [(torch.randn(shape, device=dev, dtype=dtype), torch.randn(shape, device=dev, dtype=dtype))
              for _ in range(plan.handoff_layers)]  # fmt: skip
    target = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in source]
    src = torch.randperm(shape[0], device=dev)[:n]
    dst = torch.randperm(shape[0], device=dev)[:n]

    def moved() -> None:
        scatter_blocks(target, dst.tolist(), gather_blocks(source, src.tolist()), list(range(n)))

    def on_device() -> None:
        for (sk, sv), (tk, tv) in zip(source, target, strict=True):
            tk.index_copy_(0, dst, sk.index_select(0, src))
            tv.index_copy_(0, dst, sv.index_select(0, src))

    def blocks(caches: list[tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([torch.stack((k.index_select(0, ids), v.index_select(0, ids))) for k, v in caches])

    def run() -> torch.Tensor:
        moved()
        return blocks(target, dst)

    return Case(
        kernel="kv_handoff",
        shape={
            "blocks": n,
            "layers": plan.handoff_layers,
            "kv_heads": plan.kv_heads,
            "head_dim": plan.head_dim,
            "block_size": plan.block_size,
        },  # fmt: skip
        run=run,
        ref=lambda: blocks(source, src),
        exact=None,
        baseline=on_device,
        bench=moved,
        bytes=2 * plan.handoff_layers * src.numel() * source[0][0][0].numel() * source[0][0].element_size(),
    )
