"""One prompt's KV handed from one engine to another through each KV transport, in one run on
SmolLM2: `object_store` (the exporter's workers gather the blocks into an array, Ray's object
store holds it, the importer's workers scatter it) against `ipc` (the importer's workers copy
the leased blocks straight out of the exporter's shared cache, mapped) and `nixl` (they read
them through NIXL from the exporter's registered cache). The same exporter serves all three;
each transport has its own importer, and every rep a fresh cache salt, so every block is
written (none skipped). Prefilling the same blocks is the baseline a hand-over must beat.

    .venv/bin/python docs/bench/kv_transport.py > docs/bench/kv_transport_<host>.json
    CADENZA_BENCH_COLD=1 .venv/bin/python docs/bench/kv_transport.py   # every block fresh
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from typing import Any

from cadenza.actors.async_llm import AsyncLLM
from cadenza.actors.kv_connector.handoff import move_blocks
from cadenza.actors.local_ray import init_local_ray
from cadenza.benchmarks.offline import measure_gemm_gflops, measure_read_gbps
from cadenza.config import DEFAULT_MODEL
from cadenza.sampling_params import SamplingParams
from cadenza.stats import KVTransferStats

PROMPT_TOKENS = 2048
REPS = 7
# The pools' blocks: with 256 (two prompts' worth), every block has been written and every
# page of the exporter mapped by the importer after WARMUP reps: the counted reps measure the
# steady state of a serving engine, whose blocks are reused (CADENZA_BENCH_COLD=1: 1024 blocks
# and one warm-up rep, so every counted rep writes blocks never touched before).
COLD = os.environ.get("CADENZA_BENCH_COLD") == "1"
NUM_BLOCKS = 1024 if COLD else 256
WARMUP = 1 if COLD else 3


async def prefill_s(engine: AsyncLLM, ids: list[int], salt: str) -> float:
    start = time.perf_counter()
    async for _ in engine.generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1), cache_salt=salt
    ):
        return time.perf_counter() - start
    raise RuntimeError("no output")


async def hand_over(
    source: AsyncLLM, target: AsyncLLM, ids: list[int], salt: str, places: list[str] | None
) -> tuple[float, KVTransferStats]:
    """Seconds of one hand-over of ids' cached blocks (a pull when places are the target's)."""
    stats = KVTransferStats()
    start = time.perf_counter()
    await move_blocks(source.export_kv(ids, salt, pull_at=places), target.import_kv, stats, source.release_kv)
    return time.perf_counter() - start, stats


async def measure() -> dict[str, Any]:
    source, by_store, by_ipc, by_nixl = (
        AsyncLLM(DEFAULT_MODEL, num_blocks=NUM_BLOCKS, kv_transport=t) for t in ("nixl", "ipc", "ipc", "nixl")
    )
    places = await by_ipc.kv_places()  # by_nixl's are the same: one node
    ids = [(i * 7919) % 40000 + 100 for i in range(PROMPT_TOKENS)]
    rows: dict[str, list[float]] = {"prefill": [], "object_store": [], "ipc": [], "nixl": []}
    moved: dict[str, KVTransferStats] = {}
    for rep in range(WARMUP + REPS):  # the warm-up reps are not counted
        salt = f"rep{rep}"
        prefill = await prefill_s(source, ids, salt)
        store_s, moved["object_store"] = await hand_over(source, by_store, ids, salt, None)
        ipc_s, moved["ipc"] = await hand_over(source, by_ipc, ids, salt, places)
        nixl_s, moved["nixl"] = await hand_over(source, by_nixl, ids, salt, places)
        if rep >= WARMUP:
            for key, value in (("prefill", prefill), ("object_store", store_s), ("ipc", ipc_s), ("nixl", nixl_s)):
                rows[key].append(value)
    for engine in (source, by_store, by_ipc, by_nixl):
        engine.shutdown()
    med = {k: statistics.median(v) for k, v in rows.items()}
    blocks = PROMPT_TOKENS // 16
    return {
        "what": "one prompt's KV handed between two engines: Ray's object store vs the ipc and nixl transports' pulls",
        "model": DEFAULT_MODEL,
        "prompt_tokens": PROMPT_TOKENS,
        "reps": REPS,
        "pages": "first use: every block fresh" if COLD else "steady state: blocks and mappings reused",
        "host": {"cpus": os.cpu_count(), "read_gbps": measure_read_gbps(), "gemm_gflops": measure_gemm_gflops()},
        "median_s": med,
        "blocks": {k: [s.num_blocks_imported, s.num_blocks_pulled] for k, s in moved.items()},
        "bytes_per_block": moved["ipc"].num_bytes // blocks,
        "ms_per_block": {k: round(1000 * v / blocks, 3) for k, v in med.items()},
        "object_store_over_ipc": round(med["object_store"] / med["ipc"], 2),
        "object_store_over_nixl": round(med["object_store"] / med["nixl"], 2),
        "nixl_over_ipc": round(med["nixl"] / med["ipc"], 2),
        "prefill_over_ipc": round(med["prefill"] / med["ipc"], 1),
    }


def main() -> None:
    init_local_ray(8, logging_level="error")
    print(json.dumps(asyncio.run(measure()), indent=1))


if __name__ == "__main__":
    main()
