"""The context sweep of `cadenza bench offline`: TTFT and decode speed with 0, 2k and 6k
tokens of context, each beside its bound at the machine's rates measured in the same run.

TTFT's bound is the prompt's FLOPs at the measured rate of the GEMMs the engine runs (bf16's
where cpu_gemm_dtype makes them bf16; each row also gives the ratio at the fp32 rate): the projections' 2 * params
per token (the LM head once, for the token sampled) plus causal attention's 4 * D per
(query, key) pair and head (QK^T and PV). Decode keeps the rate at the start as its baseline:
a step reads the weights and the context's KV once, so the rate falls with context only as
far as the KV bytes add to the weight bytes.

The sweep runs in rounds (every context once a round, each with a prompt of its own, so no
prefix-cache hit), and each round's ratio to the start is taken within that round: on a noisy
machine one slow start run would otherwise move every context's ratio. Rows report medians.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from cadenza.models.config import ModelConfig
from cadenza.sampling_params import SamplingParams

DEFAULT_CONTEXTS = (0, 2048, 6144)
DECODE_TOKENS = 32  # per context: enough steps for a stable rate, few enough to stay at that context
DEFAULT_SWEEP_ROUNDS = 3


def projection_params(cfg: ModelConfig) -> int:
    """Weights every prompt token multiplies (all layers' projections; not the LM head)."""
    per_layer = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    per_layer += 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * per_layer


def prefill_flops(cfg: ModelConfig, tokens: int) -> dict[str, float]:
    """GEMM and attention FLOPs of prefilling `tokens` tokens from an empty cache."""
    gemm = 2.0 * tokens * projection_params(cfg) + 2.0 * cfg.vocab_size * cfg.hidden_size
    pairs = tokens * (tokens + 1) / 2  # causal: query i sees keys 0..i
    attention = 4.0 * pairs * cfg.head_dim * cfg.num_heads * cfg.num_layers
    return {"gemm_flops": gemm, "attention_flops": attention}


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def _one(llm: Any, prompt: list[int]) -> tuple[float, float]:
    """(TTFT s, decode tok/s) of one request alone, from its metrics."""
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    start = time.time()
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    m = out.metrics[0]
    decode = (DECODE_TOKENS - 1) / (m.last_token_time - m.first_token_time)
    return m.first_token_time - start, decode


def context_sweep(
    llm: Any,
    cfg: ModelConfig,
    gemm_gflops: float,
    contexts: tuple[int, ...],
    seed: int,
    rounds: int = 1,
    fp32_gemm_gflops: float | None = None,
) -> dict:
    """TTFT and decode tok/s per context length, with the ratios the issue's targets read:
    medians over `rounds` interleaved rounds, each round's values in `rounds`."""
    rng = random.Random(seed)
    _one(llm, [rng.randrange(100, cfg.vocab_size) for _ in range(16)])  # warm-up
    runs: dict[int, list[dict[str, float]]] = {n: [] for n in contexts}
    for _ in range(rounds):
        for n in contexts:
            ttft, decode = _one(llm, [rng.randrange(100, cfg.vocab_size) for _ in range(max(n, 16))])
            runs[n].append({"ttft_s": ttft, "decode_tok_s": decode})
        for n in contexts:  # this round's ratio to this round's start
            runs[n][-1]["decode_vs_start"] = runs[n][-1]["decode_tok_s"] / runs[contexts[0]][-1]["decode_tok_s"]
    fp32 = fp32_gemm_gflops or gemm_gflops
    return {str(n): _row(cfg, max(n, 16), runs[n], gemm_gflops, fp32) for n in contexts}


def _row(
    cfg: ModelConfig, tokens: int, runs: list[dict[str, float]], gemm_gflops: float, fp32_gflops: float
) -> dict[str, Any]:
    flops = prefill_flops(cfg, tokens)
    bound_s = (flops["gemm_flops"] + flops["attention_flops"]) / (gemm_gflops * 1e9)
    ttft = statistics.median(r["ttft_s"] for r in runs)
    return {
        "prompt_tokens": tokens,
        "ttft_s": ttft,
        **flops,
        "flops_bound_s": bound_s,
        "gemm_only_bound_s": flops["gemm_flops"] / (gemm_gflops * 1e9),
        "ttft_over_bound": ttft / bound_s,
        "ttft_over_gemm_only": ttft / (flops["gemm_flops"] / (gemm_gflops * 1e9)),
        "ttft_over_fp32_bound": ttft * fp32_gflops * 1e9 / (flops["gemm_flops"] + flops["attention_flops"]),
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "decode_vs_start": statistics.median(r["decode_vs_start"] for r in runs),
        "rounds": runs,
    }
