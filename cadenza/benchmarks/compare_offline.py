"""`cadenza bench serve --compare-offline`: the same prompts in-process and through the server,
in one run, and what the server adds as ratios (served / in-process) of TTFT, TPOT and
throughput.

In-process is `LLM` on the served model in this process, with its defaults (the server's
format when it too runs with defaults), the prompts rendered through the same chat template
the HTTP and websocket paths use. Concurrency is reproduced as it can be with a synchronous
engine: concurrency 1 runs the requests one after another; no limit (all at once) runs them as
one batch; any other limit runs batches of that many. The server must be on this machine (the
two runs share its cores), and is run first, then the in-process engine, so neither warms the
other's caches: prefix caching makes no difference on the seeded synthetic prompts.
"""

from __future__ import annotations

import time
from typing import Any

from cadenza.benchmarks.report import percentiles_ms
from cadenza.sampling_params import SamplingParams

COMPARED = ("ttft_ms", "tpot_ms")


def run_in_process(model: str, prompts: list[str], max_tokens: list[int], concurrency: int | None) -> dict[str, Any]:
    """TTFT / TPOT (ms, percentiles) and throughput of the prompts on an in-process LLM."""
    from cadenza.actors.llm import LLM

    llm = LLM(model)
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], True) for p in prompts]
    requests = [
        ({"prompt": text, "chat": True}, SamplingParams(max_tokens=n, ignore_eos=True))
        for text, n in zip(texts, max_tokens)
    ]
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    size = len(requests) if not concurrency else concurrency
    ttfts, tpots, tokens = [], [], 0
    start = time.perf_counter()
    for i in range(0, len(requests), size):
        group = requests[i : i + size]
        sent = time.time()
        outs = llm.generate([p for p, _ in group], [s for _, s in group], use_tqdm=False)
        for out in outs:
            m, n = out.metrics[0], len(out.outputs[0].token_ids)
            tokens += n
            ttfts.append(m.first_token_time - sent)
            if n > 1:
                tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
    elapsed = time.perf_counter() - start
    return {
        "completed": len(requests),
        "elapsed_s": elapsed,
        "request_throughput": len(requests) / elapsed,
        "output_token_throughput": tokens / elapsed,
        "ttft_ms": percentiles_ms(ttfts),
        "tpot_ms": percentiles_ms(tpots),
    }


def overhead(served: dict[str, Any], in_process: dict[str, Any]) -> dict[str, float | None]:
    """served / in-process for each latency's p50 and mean, in-process / served for throughput
    (so every ratio above 1 is what the server costs)."""
    ratios: dict[str, float | None] = {}
    for name in COMPARED:
        for stat in ("p50", "mean"):
            a, b = served[name].get(stat), in_process[name].get(stat)
            ratios[f"{name}_{stat}"] = a / b if a and b else None
    a, b = in_process["output_token_throughput"], served["output_token_throughput"]
    ratios["output_throughput"] = a / b if a and b else None
    return ratios
