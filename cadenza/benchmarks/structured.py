"""`cadenza bench structured`: what a JSON-schema grammar costs per output token.

The same prompts, decoded greedily three ways in one run: free text, with the grammar's
masks computed while the forward pass runs (the default), and with them computed after it
(overlap off). Each gives TPOT (decode time / output tokens) and the mask time per token;
the ratios against free text are the cost. The schema forces a long reply (a list of 24
short strings), so decode, not prefill, dominates. A batch is n copies of one prompt, so
greedy replies are equally long and every step is n wide in each configuration.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from cadenza.benchmarks.offline import measure_gemm_gflops, measure_read_gbps
from cadenza.benchmarks.report import report
from cadenza.config import DEFAULT_MODEL
from cadenza.sampling_params import SamplingParams
from cadenza.structured_outputs import StructuredOutputs

NAMES = {"type": "array", "items": {"type": "string", "minLength": 4, "maxLength": 12}, "minItems": 24, "maxItems": 24}
LIST_SCHEMA = {
    "type": "object",
    "properties": {"items": NAMES},
    "required": ["items"],
    "additionalProperties": False,
}


def add_structured_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated concurrent requests")
    p.add_argument("--rounds", type=int, default=3, help="runs per configuration (the median is kept)")
    p.add_argument("--output", default=None, help="also write the JSON here")


def _prompts(llm: Any, n: int) -> list[dict[str, Any]]:
    """n copies of one prompt: greedy replies are then equally long, so the batch stays n wide
    to the end in every configuration, and steps compare like for like."""
    ask = [{"role": "user", "content": "List 24 short names of things in a kitchen, as JSON."}]
    return [{"prompt": llm.get_tokenizer().apply_chat_template(ask), "chat": True}] * n


class _TimedMasks:
    """Wraps the runner's mask computation to count its time (in whichever thread runs it)."""

    def __init__(self, matchers: Any) -> None:
        self.matchers, self.seconds = matchers, 0.0
        self.inner = matchers.masks
        matchers.masks = self

    def __call__(self, queries: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.inner(queries)
        finally:
            self.seconds += time.perf_counter() - start


def _run(llm: Any, prompts: list[str], params: SamplingParams, timer: _TimedMasks) -> dict[str, float]:
    timer.seconds = 0.0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    first = max((m.ttft for o in outs for m in o.metrics if m.ttft is not None), default=0.0)
    decode = elapsed - first
    return {
        "tpot_ms": decode / max(max(lengths) - 1, 1) * 1e3,
        "output_tokens": sum(lengths),
        "max_output_tokens": max(lengths),
        "mask_ms_per_token": timer.seconds / sum(lengths) * 1e3,
        "mask_share_of_decode": timer.seconds / decode if decode > 0 else 0.0,
    }


def _median(runs: list[dict[str, float]]) -> dict[str, float]:
    ordered = sorted(runs, key=lambda r: r["tpot_ms"])
    return ordered[len(ordered) // 2]


def run_structured_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from cadenza.actors.llm import LLM

    machine = {"torch_threads": torch.get_num_threads(), "fp32_gemm_gflops": measure_gemm_gflops()}
    machine["mem_read_gbps"] = measure_read_gbps()
    llm = LLM(args.model, num_blocks=1024)
    runner = llm.engine.runner
    timer = _TimedMasks(runner.grammar)
    grammar = StructuredOutputs(json=LIST_SCHEMA)
    results: dict[str, Any] = {"model": args.model, "machine": machine, "schema": LIST_SCHEMA, "batches": {}}
    for n in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = _prompts(llm, n)
        json_params = SamplingParams(temperature=0, max_tokens=400, structured_outputs=grammar)
        _run(llm, prompts, json_params, timer)  # warm: the grammar tokenizer is built on first use
        length = _run(llm, prompts, json_params, timer)["max_output_tokens"]
        free = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True)
        configs = {
            "free": (free, True),
            "grammar_overlapped": (json_params, True),
            "grammar_inline": (json_params, False),  # masks computed after the forward pass
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
        for _ in range(args.rounds):  # interleaved, so the host's drift touches each alike
            for name, (params, overlap) in configs.items():
                runner.grammar.overlap = overlap
                runs[name].append(_run(llm, prompts, params, timer))
        runner.grammar.overlap = True
        row: dict[str, Any] = {name: _median(r) for name, r in runs.items()}
        base = row["free"]["tpot_ms"]
        row["tpot_ratio_overlapped"] = row["grammar_overlapped"]["tpot_ms"] / base
        row["tpot_ratio_inline"] = row["grammar_inline"]["tpot_ms"] / base
        results["batches"][str(n)] = row
    return report(results, args.output)
