"""`cadenza bench formats`: one model in each weight format, as JSON and a bar chart.

Every format (fp32, bf16, int8, int4, the GGUF as stored) is loaded, measured and freed in
turn in one process, beside the machine's read bandwidth and fp32 GEMM rate measured in the
same run, so each figure reads as a ratio against fp32 of the same run rather than against
a figure from another day on a host whose bandwidth drifts with its other tenants.
"""

from __future__ import annotations

import argparse
import gc
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cadenza.benchmarks.context_sweep import projection_params
from cadenza.benchmarks.offline import (
    cadenza_single_stream,
    make_workload,
    measure_gemm_gflops,
    measure_read_gbps,
)
from cadenza.benchmarks.report import report
from cadenza.config import DEFAULT_MODEL
from cadenza.models.config import ModelConfig
from cadenza.models.gguf_reader import field_value, open_gguf
from cadenza.models.model_files import resolve_model_path
from cadenza.outputs import RequestOutput
from cadenza.sampling_params import SamplingParams

# Format name -> the LLM keyword arguments that select it. "-a8": the CPU's q4 / q8 kernels
# with int8_activations (x rounded to int8 per block of 32, as llama.cpp; not exact).
FORMATS: dict[str, dict[str, str | bool]] = {
    "fp32": {"dtype": "float32", "quantization": "none"},
    "bf16": {"dtype": "bfloat16", "quantization": "none"},
    "fp16": {"dtype": "float16", "quantization": "none"},
    "int8": {"quantization": "int8", "int8_activations": False},  # exact, whatever the host's default
    "int4": {"quantization": "int4", "int8_activations": False},
    "gguf": {"quantization": "gguf", "int8_activations": False},
    "int8-a8": {"quantization": "int8", "int8_activations": True},
    "int4-a8": {"quantization": "int4", "int8_activations": True},
    "gguf-a8": {"quantization": "gguf", "int8_activations": True},
}
DEFAULT_FORMATS = ("fp32", "bf16", "int8", "int4", "gguf", "int8-a8", "int4-a8", "gguf-a8")
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx")
SINGLE_PROMPT_LEN = 32  # the single-stream decode's prompt: short, so decode dominates
BATCH_INPUT_LEN = (84, 116)  # about 100 tokens in
BATCH_OUTPUT_LEN = 128
# (result key, panel title) of the chart's three panels.
PANELS = (("decode_tok_s", "single-stream decode (tok/s)"), ("ttft_ms", "TTFT (ms)"), ("batch_tok_s", "batch (tok/s)"))
RATIOS = {"decode_tok_s": "decode_vs_fp32", "ttft_ms": "ttft_vs_fp32", "batch_tok_s": "batch_vs_fp32"}

LLMFactory = Callable[..., Any]  # (model, **engine kwargs) -> an LLM


def add_formats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF directory, .gguf file or packaged model name")
    formats_help = f"comma-separated, from {','.join(FORMATS)}"
    p.add_argument("--formats", type=_format_list, default=list(DEFAULT_FORMATS), help=formats_help)
    p.add_argument("--decode-tokens", type=_at_least(2), default=128, help="single-stream decode length")
    p.add_argument("--rounds", type=_at_least(1), default=3, help="decode and TTFT: best of this many")
    p.add_argument("--prompt-len", type=_at_least(1), default=512, help="TTFT prompt length (tokens)")
    p.add_argument("--batch-requests", type=_at_least(1), default=32, help="requests submitted at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument("--png", default="bench_formats.png", help='bar chart of the three figures ("" for none)')


def _at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < lowest:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {lowest}, got {text!r}")
        return int(text)

    return parse


def _format_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown formats {unknown}; known: {','.join(FORMATS)}")
    return list(dict.fromkeys(names))  # a format named twice is measured once


def make_llm(model: str, **kwargs: Any) -> Any:
    from cadenza.actors.llm import LLM  # late: `cadenza bench formats --help` stays fast

    return LLM(model, **kwargs)


# --- the machine -------------------------------------------------------------------------


def cpu_info(path: str = "/proc/cpuinfo") -> tuple[str, set[str]]:
    """(model name, ISA flags) of the first CPU listed; ("unknown", {}) where there is no such file."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return "unknown", set()
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields.get("model name", "unknown"), set(fields.get("flags", "").split())


def isa_flags(flags: set[str]) -> dict[str, bool]:
    # AMX comes as several flags (amx_tile, amx_bf16, amx_int8); any of them counts.
    return {f: any(x.startswith("amx") for x in flags) if f == "amx" else f in flags for f in ISA_FLAGS}


def measure_machine() -> dict[str, Any]:
    import torch

    name, flags = cpu_info()
    return {
        "cpu": name,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "isa": isa_flags(flags),
        "mem_read_gbps": measure_read_gbps(),
        "fp32_gemm_gflops": measure_gemm_gflops(),
    }


# --- the model ---------------------------------------------------------------------------


def count_weights(cfg: ModelConfig) -> int:
    """Distinct weights (a tied lm_head counted once), as model.weight_bytes() counts bytes,
    from the config alone: a quantized model no longer holds its dense tensors to count."""
    h, q, kv = cfg.hidden_size, cfg.q_size, cfg.kv_size
    layer = 2 * h + (q + 2 * kv) * cfg.qkv_bias + h * cfg.o_bias  # two norms and the biases
    lm_head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h
    return cfg.vocab_size * h + projection_params(cfg) + cfg.num_layers * layer + h + lm_head


def gguf_stored_type(model: str) -> str | None:
    """The GGUF's stored type from its general.file_type (MOSTLY_Q4_1 -> "q4_1"); None for a
    model that is not a GGUF file or a file that does not say."""
    import gguf

    try:
        path = resolve_model_path(model)
        code = None if path.is_dir() else field_value(open_gguf(path), "general.file_type")
        return None if code is None else gguf.LlamaFileType(code).name.removeprefix("MOSTLY_").lower()
    except ValueError:
        return None


def format_label(name: str, model: str) -> str:
    stored = gguf_stored_type(model) if name.startswith("gguf") else None
    return name.replace("gguf", f"gguf-{stored}") if stored else name


def _model(llm: Any) -> Any:
    model = getattr(llm, "model", None)
    return llm.engine.runner.model if model is None else model


# --- one format --------------------------------------------------------------------------


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def prefill_ttft_s(llm: Any, prompt: list[int]) -> float:
    out = llm.generate({"prompt_token_ids": prompt}, _greedy(1), use_tqdm=False)[0]
    return out.metrics[0].ttft


def batch_tok_s(llm: Any, prompts: list[list[int]]) -> float:
    """Output tokens/s of all prompts submitted at once: first arrival to last token, as the
    engine timed them (the caller's loop around generate() is no part of it)."""
    outs: list[RequestOutput] = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], _greedy(BATCH_OUTPUT_LEN), use_tqdm=False
    )
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    span = max(o.metrics[0].last_token_time for o in outs) - min(o.metrics[0].arrival_time for o in outs)
    return tokens / span


def workloads(vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    """The same seeded prompts for every format (they share the model's vocabulary)."""

    def prompt(length: int, seed: int) -> list[int]:
        return make_workload(1, (length, length), (1, 1), vocab, seed)[0][0]

    batch = make_workload(args.batch_requests, BATCH_INPUT_LEN, (1, 1), vocab, args.seed)
    return {
        "single": prompt(SINGLE_PROMPT_LEN, args.seed + 1),
        "long": prompt(args.prompt_len, args.seed + 2),
        "batch": [p for p, _ in batch],
    }


def measure_llm(llm: Any, args: argparse.Namespace) -> dict[str, Any]:
    cfg = llm.engine.model_config
    work = workloads(cfg.vocab_size, args)
    weight_bytes, num_weights = _model(llm).weight_bytes(), count_weights(cfg)
    llm.generate({"prompt_token_ids": work["single"]}, _greedy(4), use_tqdm=False)  # warm-up
    gbps = measure_read_gbps()  # just before the decode: the bound it is judged by, not one from minutes ago
    decode = [cadenza_single_stream(llm, (work["single"], args.decode_tokens)) for _ in range(args.rounds)]
    ttft = [prefill_ttft_s(llm, work["long"]) for _ in range(args.rounds)]
    return {
        "weights": getattr(_model(llm), "weights_label", None),  # as the loader resolved it
        "weight_bytes": weight_bytes,
        "num_weights": num_weights,
        "bytes_per_weight": weight_bytes / num_weights,
        "decode_tok_s": max(decode),
        "decode_rounds_tok_s": decode,
        "mem_read_gbps": gbps,
        "decode_fraction_of_bound": max(decode) * weight_bytes / (gbps * 1e9),
        "ttft_ms": min(ttft) * 1e3,
        "ttft_rounds_ms": [t * 1e3 for t in ttft],
        "batch_tok_s": batch_tok_s(llm, work["batch"]),
    }


def bench_format(factory: LLMFactory, model: str, kwargs: dict[str, str], args: argparse.Namespace) -> dict:
    """Load one format, measure it and free it before the caller loads the next: two models
    resident at once would be measured against each other's memory traffic (and may not fit)."""
    try:
        # Prefix caching off: every TTFT round is a real prefill, not a cache hit.
        llm = factory(model, enable_prefix_caching=False, **kwargs)
    except Exception as e:  # a format this engine or model cannot load: say so, measure the rest
        error = f"{type(e).__name__}: {e}"
    else:
        try:
            return {**kwargs, **measure_llm(llm, args)}
        finally:
            del llm
            gc.collect()
    gc.collect()  # what the failed load had allocated (its traceback is gone now), before the next
    return {**kwargs, "error": error}


# --- the report --------------------------------------------------------------------------


def add_ratios(results: dict[str, dict]) -> None:
    """Each format against fp32 of the same run (None where fp32 was not measured)."""
    base = results.get("fp32")
    base = None if base is None or "error" in base else base
    for r in results.values():
        if "error" in r:
            continue
        for key, ratio in RATIOS.items():
            r[ratio] = None if base is None else r[key] / base[key]


def chart_title(model: str, machine: dict[str, Any]) -> str:
    isa = ", ".join(f for f, present in machine["isa"].items() if present) or "no listed ISA flags"
    return (
        f"{model} on {machine['cpu']} ({machine['cores']} cores, {machine['torch_threads']} torch threads; {isa})\n"
        f"read {machine['mem_read_gbps']:.1f} GB/s, fp32 GEMM {machine['fp32_gemm_gflops']:.0f} GFLOP/s"
    )


def write_png(path: str, results: dict[str, dict], title: str) -> str | None:
    """The bar chart; None (and no file) where matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    measured = {name: r for name, r in results.items() if "error" not in r}
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.4))
    for ax, (key, panel) in zip(axes, PANELS):
        bars = ax.bar(list(measured), [r[key] for r in measured.values()], color="#4a72b0")
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(panel)
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_formats_bench(args: argparse.Namespace, factory: LLMFactory | None = None) -> dict[str, Any]:
    factory = factory or make_llm  # looked up here, so a test can swap the module's make_llm
    machine = measure_machine()
    results: dict[str, dict] = {}
    for name in args.formats:
        results[format_label(name, args.model)] = bench_format(factory, args.model, FORMATS[name], args)
    add_ratios(results)
    result: dict[str, Any] = {
        "model": args.model,
        "workload": {
            "decode_tokens": args.decode_tokens,
            "rounds": args.rounds,
            "prompt_len": args.prompt_len,
            "batch_requests": args.batch_requests,
            "batch_input_len": f"{BATCH_INPUT_LEN[0]}:{BATCH_INPUT_LEN[1]}",
            "batch_output_len": BATCH_OUTPUT_LEN,
            "seed": args.seed,
        },
        "machine": machine,
        "formats": results,
    }
    result["png"] = write_png(args.png, results, chart_title(args.model, machine)) if args.png else None
    if args.png and result["png"] is None:
        result["png_skipped"] = "matplotlib is not installed (pip install matplotlib)"
    return report(result, args.output)
