"""`cadenza bench offline`: throughput, latency and the machine's own limits, as JSON.

The machine is measured in the same run (fp32 GEMM FLOP/s, memory read GB/s), so every
figure can be read as a ratio: decode speed against the bandwidth bound, Cadenza against
HF transformers on the same requests.

`memory` is this process's resident memory beside the weights: the peak (VmHWM) over the
model's load and the throughput run, counted from just before the load (the bandwidth
probe's 1 GiB buffer is not the engine's), and the RSS once loaded.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cadenza.benchmarks.context_sweep import DEFAULT_CONTEXTS, DEFAULT_SWEEP_ROUNDS, context_sweep
from cadenza.benchmarks.memory import MB, own_peak_rss_bytes, own_rss_bytes, reset_own_peak_rss
from cadenza.benchmarks.report import report
from cadenza.engine_args import engine_kwargs
from cadenza.models.model_files import resolve_model_path
from cadenza.sampling_params import SamplingParams

# torch is imported where it is used: `cadenza serve` parses these flags without it.
if TYPE_CHECKING:
    import torch

Workload = list[tuple[list[int], int]]  # (prompt ids, output length)


def add_offline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--input-len", default="32:512", help="prompt length range lo:hi (inclusive)")
    p.add_argument("--output-len", default="16:256", help="output length range lo:hi (inclusive)")
    p.add_argument("--single-stream-tokens", type=int, default=128)
    rounds_help = "rounds of (read GB/s, one decode run)"
    p.add_argument("--single-stream-rounds", type=_at_least_one, default=3, help=rounds_help)
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument(
        "--contexts",
        type=_contexts,
        default=DEFAULT_CONTEXTS,
        help="context sweep: TTFT and decode tok/s at these context lengths (comma-separated; 'none' to skip)",
    )
    p.add_argument(
        "--sweep-rounds",
        type=_at_least_one,
        default=DEFAULT_SWEEP_ROUNDS,
        help="interleaved rounds of the context sweep (medians reported)",
    )
    p.add_argument("--output", default=None, help="also write the JSON here")


def _contexts(text: str) -> tuple[int, ...]:
    if text == "none":
        return ()
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"context lengths are whole numbers, comma-separated: {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"context lengths must be >= 0, got {text!r}")
    return values


def _at_least_one(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return int(text)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def make_workload(n: int, inputs: tuple[int, int], outputs: tuple[int, int], vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    # Skip the low ids, where special tokens live, so prompts are ordinary text tokens.
    return [([rng.randrange(100, vocab) for _ in range(rng.randint(*inputs))], rng.randint(*outputs)) for _ in range(n)]


def measure_gemm_gflops(
    n: int = 1024, reps: int = 10, dtype: torch.dtype | None = None, budget_s: float = 1.0
) -> float:
    """torch.mm's rate on n x n matrices, in fp32 unless dtype says otherwise: up to `reps`
    products, stopping once `budget_s` has passed, because bf16 emulated on a CPU without bf16
    hardware takes seconds a product (a rate from one product is as good)."""
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)  # None: the default, fp32
    c = torch.mm(a, b)
    start = time.perf_counter()
    done = 0
    while done < reps and (done == 0 or time.perf_counter() - start < budget_s):
        torch.mm(a, b, out=c)
        done += 1
    return 2 * n**3 * done / (time.perf_counter() - start) / 1e9


def measure_read_gbps(megabytes: int = 1024, reps: int = 5) -> float:
    import torch

    x = torch.ones(megabytes * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def _greedy(out_len: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)


def bench_cadenza(llm: Any, workload: Workload) -> dict[str, float]:
    llm.generate({"prompt_token_ids": workload[0][0][:16]}, _greedy(4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in workload], [_greedy(n) for _, n in workload], use_tqdm=False
    )
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    metrics = [o.metrics[0] for o in outs]
    tpots = [
        (m.finished_time - m.first_token_time) / (len(o.outputs[0].token_ids) - 1)
        for m, o in zip(metrics, outs)
        if len(o.outputs[0].token_ids) > 1
    ]
    return {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "output_tok_s": n_out / elapsed,
        "total_tok_s": (n_out + sum(len(p) for p, _ in workload)) / elapsed,
        "mean_ttft_s": statistics.mean(m.ttft for m in metrics),
        "mean_tpot_s": statistics.mean(tpots),
        "preemptions": llm.stats().num_preemptions,
    }


def cadenza_single_stream(llm: Any, single: tuple[list[int], int]) -> float:
    """Decode tokens/s of one request alone (the first token, i.e. the prefill, excluded)."""
    one = llm.generate({"prompt_token_ids": single[0]}, _greedy(single[1]), use_tqdm=False)[0]
    m = one.metrics[0]
    return (single[1] - 1) / (m.last_token_time - m.first_token_time)


def single_stream_rounds(decode_tok_s: Callable[[], float], weight_bytes: int, rounds: int) -> dict[str, Any]:
    """Single-stream decode against the bandwidth bound measured just before it, `rounds` times.

    This host's read bandwidth drifts by +-15% over minutes (other tenants), so a bound taken
    at the start of the run and a decode timed minutes later disagree by that much; pairing
    each decode run with a bound measured seconds before it, and taking the median round,
    keeps the fraction a property of the code rather than of the moment."""
    runs = []
    for _ in range(rounds):
        gbps = measure_read_gbps()
        tok_s = decode_tok_s()
        runs.append({"mem_read_gbps": gbps, "decode_tok_s": tok_s, "fraction": tok_s * weight_bytes / (gbps * 1e9)})
    median = sorted(runs, key=lambda r: r["fraction"])[len(runs) // 2]
    return {
        "single_stream_decode_tok_s": median["decode_tok_s"],
        "single_stream_fraction_of_bound": median["fraction"],
        "single_stream_rounds": runs,
    }


def memory_summary(peak_bytes: int, loaded_bytes: int, weight_bytes: int, peak_reset: bool) -> dict[str, Any]:
    """The engine's resident memory against its weights (megabytes of 10^6 bytes)."""
    return {
        "peak_rss_mb": peak_bytes / MB,
        "rss_after_load_mb": loaded_bytes / MB,
        "weight_mb": weight_bytes / MB,
        "peak_over_weights": peak_bytes / weight_bytes,
        # Where the kernel refuses to reset the peak, it counts from the process's start.
        "peak_since": "model load" if peak_reset else "process start (bandwidth probe included)",
    }


def load_hf(model: str) -> torch.nn.Module:
    import torch
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(model)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def _hf_generate(model: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> None:
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )


def bench_hf(model: torch.nn.Module, workload: Workload, batch: int) -> dict:
    """Static batches in arrival order, padded, each run to its longest output (how HF is used)."""
    start = time.perf_counter()
    for i in range(0, len(workload), batch):
        chunk = workload[i : i + batch]
        _hf_generate(model, [p for p, _ in chunk], max(n for _, n in chunk))
    elapsed = time.perf_counter() - start
    n_out = sum(n for _, n in workload)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "output_tok_s": n_out / elapsed}


def hf_single_stream(model: torch.nn.Module, single: tuple[list[int], int]) -> float:
    """Decode tokens/s of one prompt alone, from the time each token is done (a stopping
    criterion sees every step), first to last: the same span Cadenza's metrics measure.
    (A full run less a prefill-only run could come out negative on a noisy machine.)"""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    stamps: list[float] = []

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> bool:
            stamps.append(time.perf_counter())
            return False

    ids = torch.tensor([single[0]])
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=single[1],
            min_new_tokens=single[1],
            pad_token_id=0,
            stopping_criteria=StoppingCriteriaList([Stamp()]),
        )
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def run_offline_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from cadenza.actors.llm import LLM  # late: `cadenza bench offline --help` stays fast

    torch.manual_seed(args.seed)
    machine = {
        "torch_threads": torch.get_num_threads(),
        "fp32_gemm_gflops": measure_gemm_gflops(),
        "mem_read_gbps": measure_read_gbps(),
    }
    peak_reset = reset_own_peak_rss()
    llm = LLM(args.model, **engine_kwargs(args))
    loaded_rss = own_rss_bytes()
    model = llm.engine.runner.model
    # The prompt's GEMMs run in this dtype (cpu_gemm_dtype): its rate is the bound's.
    gemm_dtype = llm.engine.config.weight_format.gemm_dtype
    machine["bf16_gemm_gflops"] = measure_gemm_gflops(dtype=torch.bfloat16)
    machine["gemm_dtype"] = str(gemm_dtype).removeprefix("torch.")
    gemm_rate = machine["bf16_gemm_gflops"] if gemm_dtype == torch.bfloat16 else machine["fp32_gemm_gflops"]
    weight_bytes = model.weight_bytes()
    machine |= {"weight_bytes": weight_bytes, "decode_bound_tok_s": machine["mem_read_gbps"] * 1e9 / weight_bytes}
    vocab = llm.engine.model_config.vocab_size
    workload = make_workload(args.num_requests, _range(args.input_len), _range(args.output_len), vocab, args.seed)
    single = (make_workload(1, (32, 32), (1, 1), vocab, args.seed + 1)[0][0], args.single_stream_tokens)
    result: dict[str, Any] = {
        "model": args.model,
        "dtype": args.dtype,
        "weights": model.weights_label,  # the format as loaded (--dtype / --quantization resolved)
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "machine": machine,
    }
    rounds = args.single_stream_rounds
    result["cadenza"] = bench_cadenza(llm, workload)
    result["memory"] = memory_summary(own_peak_rss_bytes(), loaded_rss, weight_bytes, peak_reset)
    result["cadenza"] |= single_stream_rounds(lambda: cadenza_single_stream(llm, single), weight_bytes, rounds)
    if args.contexts:
        cfg = llm.engine.model_config
        result["context_sweep"] = context_sweep(
            llm, cfg, gemm_rate, args.contexts, args.seed + 2, args.sweep_rounds, machine["fp32_gemm_gflops"]
        )
    if args.baseline == "hf":
        del llm
        hf_model = load_hf(args.model)
        hf = bench_hf(hf_model, workload, args.hf_batch_size)
        hf |= single_stream_rounds(lambda: hf_single_stream(hf_model, single), weight_bytes, rounds)
        result["hf"] = hf
        result["output_tok_s_ratio_vs_hf"] = result["cadenza"]["output_tok_s"] / hf["output_tok_s"]
    return report(result, args.output)
