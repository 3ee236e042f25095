"""Recompute vs copy for a session the router moves: TTFT of a continuation with its
prefix cached (the same replica) and recomputed (a fresh engine, as on another replica), and
a Ray object-store round trip of the prefix's KV bytes (what copying them would move).

    python -m cadenza.benchmarks.moved_session > docs/bench/moved_session.json
"""

import json
import time
from typing import Any

import numpy as np
import ray

from cadenza.actors.llm import LLM
from cadenza.benchmarks.offline import measure_gemm_gflops, measure_read_gbps
from cadenza.sampling_params import SamplingParams

HISTORY = [{"role": "user", "content": "Here is a long document about lighthouses. " * 60}]
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def _ttft(engine: LLM, turn: list[dict[str, Any]]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = engine.chat([turn], ONE_TOKEN, use_tqdm=False)[0]
    return time.perf_counter() - start, out


def _object_store_round_trip(num_bytes: int) -> float:
    """put + get of that many bytes through the local object store (a copy's floor)."""
    ray.init(num_cpus=1, include_dashboard=False)
    try:
        payload = np.ones(num_bytes // 4, dtype=np.float32)
        start = time.perf_counter()
        ray.get(ray.put(payload))
        return time.perf_counter() - start
    finally:
        ray.shutdown()


def main() -> None:
    machine = {"gemm_gflops": measure_gemm_gflops(), "read_gbps": measure_read_gbps()}
    llm = LLM(num_blocks=1024)
    first = llm.chat([HISTORY], SamplingParams(temperature=0, max_tokens=16))[0]
    reply = {"role": "assistant", "content": first.outputs[0].text}
    turn = [*HISTORY, reply, {"role": "user", "content": "Summarise it."}]
    cached_s, out = _ttft(llm, turn)
    recompute_s, moved = _ttft(LLM(num_blocks=1024), turn)  # another replica: nothing cached
    cfg = llm.engine.model_config
    kv_bytes = out.num_cached_tokens * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K and V
    result = {
        "machine": machine,
        "prompt_tokens": len(out.prompt_token_ids),
        "cached_tokens_same_replica": out.num_cached_tokens,
        "cached_tokens_moved": moved.num_cached_tokens,
        "ttft_cached_s": cached_s,
        "ttft_recomputed_s": recompute_s,
        "prefix_kv_bytes_fp32": kv_bytes,
        "object_store_put_get_s": _object_store_round_trip(kv_bytes),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
