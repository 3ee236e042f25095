"""GPU check: every Triton kernel against its torch reference at real shapes, timed against torch,
then the whole engine on a Llama-3.2-1B-shaped random model against transformers (gpu_model.py).

    cadenza gpu-check [--quick] [--dtype bf16|fp16|both] [--budget-s 240]

Shapes are those of an 8B Llama (32 query heads, 8 KV heads of 128, hidden 4096): decode
batches of 1-256 over contexts of 128-32k tokens (at most 2^20 context tokens per case, so
the fp32 reference fits in memory), prefills of 1-4 requests of 512-8k tokens, an extend
after a prefix-cache hit, speculative verification (5 tokens per request), and the
quantized GEMMs at K = N = 4096 for M in 1..256. Prints one JSON document: per case the
max error (kernel and torch reference, both against an fp32 reference), pass/fail by the
tests' rule (within 2x the reference's error), ms, speedup over torch, GB/s and TFLOP/s.
Torch runs: scaled_dot_product_attention on contiguous K/V for attention, a plain matmul
on pre-dequantized weights for the GEMMs, the eager reference for the rest.

Exit status: 0 all passed, 1 a case failed or was skipped, 2 no CUDA. Cases stop being
started once the budget (seconds) is spent; the rest are then listed as skipped. `--device
cpu --tiny` runs the same checks on tiny shapes under the Triton interpreter (its timings
mean nothing; a test uses it to exercise the checking and reporting).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch

from cadenza.benchmarks.gpu_cases import (
    DTYPES,
    Case,
    Plan,
    attention_cases,
    elementwise_cases,
    gemm_cases,
    kv_handoff_cases,
    make_plan,
)
from cadenza.benchmarks.gpu_check_args import add_gpu_check_args
from cadenza.benchmarks.gpu_ipc_case import kv_pull_cases
from cadenza.benchmarks.gpu_model import copy_bandwidth_gb_s
from cadenza.benchmarks.gpu_moe_cases import moe_cases


def bench_ms(fn: Callable[[], object], dev: torch.device, warmup_ms: int, rep_ms: int) -> float:
    """Milliseconds per call: triton's do_bench on CUDA (L2 flushed between calls); off CUDA
    one warm call and one timed call, which only exercises the reporting."""
    if dev.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms)
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def evaluate(case: Case, dev: torch.device, warmup_ms: int, rep_ms: int) -> dict[str, object]:
    """Errors and pass/fail by the tests' rule, then timings of the kernel and torch."""
    got, ref = case.run(), case.ref()
    out: dict[str, object] = {"kernel": case.kernel, **case.shape}
    if case.exact is None:
        out |= {"max_error": (got.float() - ref.float()).abs().max().item(), "passed": torch.equal(got, ref)}
    else:
        exact = case.exact().float()
        ref_error = (ref.float() - exact).abs().max().item()
        kernel_error = (got.float() - exact).abs().max().item()
        floor = 1e-5 * max(exact.abs().max().item(), 1.0)
        out |= {"max_error": kernel_error, "ref_error": ref_error, "passed": kernel_error <= 2 * ref_error + floor}
        del exact
    del got, ref
    ms = bench_ms(case.bench or case.run, dev, warmup_ms, rep_ms)
    torch_ms = bench_ms(case.baseline, dev, warmup_ms, rep_ms)
    out |= {"ms": round(ms, 4), "torch_ms": round(torch_ms, 4), "speedup": float(f"{torch_ms / ms:.4g}")}
    if case.bytes:
        out["gb_s"] = round(case.bytes / ms / 1e6, 1)
    if case.flops:
        out["tflop_s"] = round(case.flops / ms / 1e9, 2)
    return out


def run_checks(plan: Plan, dtypes: list[torch.dtype], dev: torch.device, budget_s: float, quick: bool) -> dict:
    """Every case of the plan in turn, then the summary document."""
    start, results = time.perf_counter(), []
    for dtype in dtypes:
        torch.manual_seed(0)
        for family in (elementwise_cases, attention_cases, gemm_cases, moe_cases, kv_handoff_cases, kv_pull_cases):
            results += _run_family(family(plan, dtype, dev), family.__name__, dtype, dev, start + budget_s, quick)
    failed = [r for r in results if r.get("passed") is False]
    skipped = [r for r in results if "skipped" in r]
    copy_gb_s = copy_bandwidth_gb_s(dev, 1 << 30 if dev.type == "cuda" else 1 << 26)
    for r in results:
        if "gb_s" in r:
            r["fraction_of_copy_bandwidth"] = round(r["gb_s"] / copy_gb_s, 3)
    return {
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "passed": not failed and not skipped,  # every case ran, and passed
        "num_cases": len(results),
        "num_failed": len(failed),
        "num_skipped": len(skipped),
        "wall_s": round(time.perf_counter() - start, 1),
        "copy_bandwidth_gb_s": round(copy_gb_s, 1),
        # The target's measure: decode attention at contexts of 4k tokens and more.
        "decode_attention_4k_plus_min_fraction": _min_fraction(results, "decode_attention", 4096),
        "results": results,
    }


def _min_fraction(results: list[dict[str, object]], kernel: str, min_context: int) -> float | None:
    fractions = [
        r["fraction_of_copy_bandwidth"]
        for r in results
        if r["kernel"] == kernel and r.get("context", 0) >= min_context and "fraction_of_copy_bandwidth" in r
    ]
    return min(fractions) if fractions else None


def _run_family(
    cases: Iterator[Case], family: str, dtype: torch.dtype, dev: torch.device, deadline: float, quick: bool
) -> list[dict[str, object]]:
    """One family's cases until it ends or the deadline passes. A case that raises (building
    its inputs included) is reported as a failure; the other families still run."""
    warmup_ms, rep_ms = (10, 30) if quick else (25, 100)
    label, results = {"dtype": str(dtype).removeprefix("torch.")}, []
    while True:
        if time.perf_counter() > deadline:
            return results + [{"kernel": family, **label, "skipped": "time budget spent"}]
        try:
            case = next(cases, None)
            if case is None:
                return results
            results.append({**evaluate(case, dev, warmup_ms, rep_ms), **label})
        except Exception as exc:  # noqa: BLE001 - reported in the document; a failed generator is done
            results.append({"kernel": family, **label, "passed": False, "error": repr(exc)[:500]})
        case = None  # free this case's tensors before the next one is built
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cadenza gpu-check", description=__doc__.split("\n")[0])
    add_gpu_check_args(parser)
    return run_gpu_check(parser.parse_args(argv))


def run_gpu_check(args: argparse.Namespace) -> int:
    """Every case, then the whole model; prints the JSON report. 0 when all passed, 1 on a
    failure, 2 when the device is missing or the flags do not fit together."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available on this machine. Run it on a GPU host, or dry-run "
            "the checks on tiny shapes with --device cpu --tiny.",
            file=sys.stderr,
        )
        return 2
    if args.device == "cpu":
        if not args.tiny:
            print("gpu_check: --device cpu runs the Triton interpreter: add --tiny", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first kernel module is imported
    dtypes = [torch.float16] if args.device == "cpu" else DTYPES[args.dtype]  # no bf16 tl.dot there
    dev = torch.device(args.device)
    report = run_checks(make_plan(args.tiny, args.quick), dtypes, dev, args.budget_s, args.quick)
    if not args.no_model:
        report["model"] = _model_report(args.tiny, dev, dtypes[0])
        report["passed"] = report["passed"] and report["model"].get("passed", False)
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1


def _model_report(tiny: bool, dev: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """The whole-model part (gpu_model.py); a failure is reported in the document, not raised.
    Off CUDA the model runs in fp32 with the CPU kernels: the Triton interpreter would take
    minutes over a whole model, and the kernels have their own cases above."""
    from cadenza.benchmarks.gpu_model import model_check

    try:
        report = model_check(tiny, dev, dtype if dev.type == "cuda" else torch.float32, batches=(1, 8, 64))
    except Exception as exc:  # noqa: BLE001 - reported in the document
        return {"passed": False, "error": repr(exc)[:1000]}
    report["passed"] = report["vs_transformers"]["greedy_identical"]
    return report


if __name__ == "__main__":
    sys.exit(main())
