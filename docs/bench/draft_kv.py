"""A draft model's KV after a prefill/decode hand-over: moved with the blocks (what
disaggregation does) or recomputed on the decode engine. Both measured in one run on SmolLM2
with a truncated self-draft (its first DRAFT_LAYERS layers):

- recompute: what the draft adds to a fresh prompt's prefill (TTFT with the draft minus TTFT
  without, on otherwise equal engines): the work a decode engine would do per prompt;
- move: one export-then-import of the prompt's blocks between two engines with the draft
  against two without: the time and bytes the draft's KV adds to a hand-over.

    .venv/bin/python docs/bench/draft_kv.py > docs/bench/draft_kv_<host>.json
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from typing import Any

from cadenza.actors.async_llm import AsyncLLM
from cadenza.actors.kv_connector.handoff import move_kv
from cadenza.actors.local_ray import init_local_ray
from cadenza.benchmarks.offline import measure_gemm_gflops, measure_read_gbps
from cadenza.config import DEFAULT_MODEL
from cadenza.sampling_params import SamplingParams
from cadenza.stats import KVTransferStats

DRAFT_LAYERS = 8
PROMPT_TOKENS = 2048
REPS = 7


async def ttft_s(engine: AsyncLLM, ids: list[int], salt: str) -> float:
    # As a prefill engine runs the prompt: one token, no drafts proposed (the draft catches up).
    params = SamplingParams(temperature=0, max_tokens=1, num_speculative_tokens=0)
    start = time.perf_counter()
    async for _ in engine.generate({"prompt_token_ids": ids}, params, cache_salt=salt):
        return time.perf_counter() - start
    raise RuntimeError("no output")


async def moved(source: AsyncLLM, target: AsyncLLM, ids: list[int], salt: str) -> tuple[float, int]:
    """Seconds and bytes of one hand-over of ids' cached blocks from source to target."""
    stats = KVTransferStats()
    start = time.perf_counter()
    await move_kv(source.export_kv(ids, salt), target.import_kv, stats)
    return time.perf_counter() - start, stats.num_bytes


async def measure() -> dict[str, Any]:
    spec = {"method": "draft_model", "model": DEFAULT_MODEL, "draft_num_layers": DRAFT_LAYERS,
            "num_speculative_tokens": 4}  # fmt: skip
    plain = [AsyncLLM(DEFAULT_MODEL, num_blocks=1024) for _ in range(2)]
    drafted = [AsyncLLM(DEFAULT_MODEL, num_blocks=1024, speculative_config=spec) for _ in range(2)]
    ids = [(i * 7919) % 40000 + 100 for i in range(PROMPT_TOKENS)]
    rows: dict[str, list[float]] = {k: [] for k in ("ttft_plain", "ttft_draft", "move_plain", "move_draft")}
    nbytes = {}
    for rep in range(REPS + 1):  # the first rep warms every path and is not counted
        salt = f"rep{rep}"
        for name, (a, b) in (("plain", plain), ("draft", drafted)):
            ttft = await ttft_s(a, ids, salt)
            seconds, nbytes[name] = await moved(a, b, ids, salt)
            if rep:
                rows["ttft_" + name].append(ttft)
                rows["move_" + name].append(seconds)
    for engine in (*plain, *drafted):
        engine.shutdown()
    med = {k: statistics.median(v) for k, v in rows.items()}
    blocks = PROMPT_TOKENS // 16
    recompute_ms = 1000 * (med["ttft_draft"] - med["ttft_plain"])
    move_ms = 1000 * (med["move_draft"] - med["move_plain"])
    return {
        "what": "a draft model's KV after a hand-over: recomputed on the decode engine vs moved with the blocks",
        "model": f"{DEFAULT_MODEL}, draft = its first {DRAFT_LAYERS} layers",
        "prompt_tokens": PROMPT_TOKENS,
        "reps": REPS,
        "host": {"cpus": os.cpu_count(), "read_gbps": measure_read_gbps(), "gemm_gflops": measure_gemm_gflops()},
        "median_s": med,
        "bytes_per_block": {k: v // blocks for k, v in nbytes.items()},
        "move_ms_per_block": {k: round(1000 * med["move_" + k] / blocks, 2) for k in ("plain", "draft")},
        "prefill_ms_per_block": round(1000 * med["ttft_plain"] / blocks, 2),
        "draft_recompute_ms": round(recompute_ms, 1),
        "draft_move_ms": round(move_ms, 1),
        "recompute_over_move": round(recompute_ms / move_ms, 1) if move_ms > 0 else None,
    }


def main() -> None:
    init_local_ray(8, logging_level="error")
    print(json.dumps(asyncio.run(measure()), indent=1))


if __name__ == "__main__":
    main()
