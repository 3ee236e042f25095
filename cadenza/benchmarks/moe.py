"""`cadenza bench moe`: what routing saves, as JSON.

Three random checkpoints of one shape are built (with transformers) and run in one process:
- `moe`: a tiny Mixtral, 8 experts, top 2;
- `all_experts`: the same weights with every token sent to all 8 (experts_per_token = 8):
  the model expanded to its dense compute, reading every expert each step;
- `dense_same_active`: a Llama whose MLP is as wide as two experts: the same active
  parameters per token as `moe`, with no routing.
Single-stream decode compares `moe` with `all_experts` (routing should read only the chosen
experts: tokens/s near the ratio of bytes read); batch throughput at 32 requests compares
`moe` with `dense_same_active` (what grouping tokens by expert costs against one GEMM).
The machine's read bandwidth and GEMM rate are measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from cadenza.benchmarks.offline import (
    bench_cadenza,
    cadenza_single_stream,
    make_workload,
    measure_gemm_gflops,
    measure_read_gbps,
)
from cadenza.benchmarks.report import report

SHAPE = dict(
    vocab_size=4096, hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
    max_position_embeddings=1024, tie_word_embeddings=False,
)  # fmt: skip


def add_moe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--expert-size", type=int, default=1024, help="each expert's intermediate size")
    p.add_argument("--num-experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="requests in the throughput run")
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="single-stream runs per model (median)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--output", default=None, help="also write the JSON here")


def build_models(directory: Path, expert_size: int, experts: int, top_k: int) -> dict[str, Path]:
    """The three checkpoints, saved under `directory`."""
    import torch
    import transformers

    torch.manual_seed(0)
    moe_cfg = transformers.MixtralConfig(
        **SHAPE, intermediate_size=expert_size, num_local_experts=experts, num_experts_per_tok=top_k
    )
    dense_cfg = transformers.LlamaConfig(**SHAPE, intermediate_size=top_k * expert_size)
    paths = {name: directory / name for name in ("moe", "all_experts", "dense_same_active")}
    transformers.AutoModelForCausalLM.from_config(moe_cfg).save_pretrained(paths["moe"])
    transformers.AutoModelForCausalLM.from_config(moe_cfg).save_pretrained(paths["all_experts"])
    config = paths["all_experts"] / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"num_experts_per_tok": experts}))
    transformers.AutoModelForCausalLM.from_config(dense_cfg).save_pretrained(paths["dense_same_active"])
    return paths


def _measure(path: Path, args: argparse.Namespace, batch: bool) -> dict[str, Any]:
    from cadenza.actors.llm import LLM

    llm = LLM(str(path), dtype=args.dtype, num_blocks=2048, max_num_seqs=args.batch)
    single = (make_workload(1, (32, 32), (1, 1), SHAPE["vocab_size"], 1)[0][0], args.output_tokens)
    runs = sorted(cadenza_single_stream(llm, single) for _ in range(args.rounds))
    result: dict[str, Any] = {
        "weight_bytes": llm.engine.runner.model.weight_bytes(),
        "weights": llm.engine.runner.model.weights_label,
        "single_stream_decode_tok_s": runs[len(runs) // 2],
        "single_stream_runs": runs,
    }
    if batch:
        out = (args.output_tokens, args.output_tokens)
        workload = make_workload(args.batch, (96, 104), out, SHAPE["vocab_size"], 2)
        result["batch"] = bench_cadenza(llm, workload)
    return result


def run_moe_bench(args: argparse.Namespace) -> dict[str, Any]:
    machine = {"fp32_gemm_gflops": measure_gemm_gflops(), "mem_read_gbps": measure_read_gbps()}
    with tempfile.TemporaryDirectory() as tmp:
        paths = build_models(Path(tmp), args.expert_size, args.num_experts, args.top_k)
        runs = {name: _measure(path, args, batch=name != "all_experts") for name, path in paths.items()}
    moe, expanded, dense = runs["moe"], runs["all_experts"], runs["dense_same_active"]
    result = {
        "shape": SHAPE | {"expert_size": args.expert_size, "num_experts": args.num_experts, "top_k": args.top_k},
        "machine": machine,
        "runs": runs,
        "decode_moe_vs_all_experts": moe["single_stream_decode_tok_s"] / expanded["single_stream_decode_tok_s"],
        "batch_moe_vs_dense_same_active": moe["batch"]["output_tok_s"] / dense["batch"]["output_tok_s"],
        "decode_moe_vs_dense_same_active": moe["single_stream_decode_tok_s"] / dense["single_stream_decode_tok_s"],
    }
    return report(result, args.output)
