"""`cadenza bench actors`: decode step time through the actor runtime vs the in-process engine.

Each batch runs B greedy requests with short prompts in lockstep, so the time between one
request's tokens is the engine's decode step. Timestamps are taken where the caller sees the
tokens, so the actor figures include everything the runtime adds: msgpack, the Ray hop
to the engine actor, the hop to the workers (Compiled Graph or actor calls), and the batched
output pull back to the client.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from typing import Any

from cadenza.benchmarks.report import report
from cadenza.outputs import RequestMetrics
from cadenza.sampling_params import SamplingParams


def add_actor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--steps", type=int, default=48, help="decode steps per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--output", default=None, help="also write the JSON here")


def _workload(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def _step_ms(metrics: list[RequestMetrics], steps: int) -> float:
    return 1e3 * statistics.mean((m.last_token_time - m.first_token_time) / (steps - 1) for m in metrics)


def _params(steps: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)


def _in_process(llm: Any, prompts: list[list[int]], steps: int) -> float:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(steps), use_tqdm=False)
    return _step_ms([o.metrics[0] for o in outs], steps)


async def _through_actors(llm: Any, prompts: list[list[int]], steps: int) -> float:
    async def one(ids: list[int]) -> RequestMetrics:
        async for delta in llm.generate({"prompt_token_ids": ids}, _params(steps)):
            last = delta
        return last.metrics[0]

    return _step_ms(list(await asyncio.gather(*(one(p) for p in prompts))), steps)


def compare(args: argparse.Namespace, offline: Any, prompts: dict[int, list[list[int]]], compiled: bool) -> dict:
    """Alternate in-process and actor runs, `repeats` times each, and keep the medians: this
    machine's timing noise is larger than the effect being measured."""
    from cadenza.actors.async_llm import AsyncLLM

    llm = AsyncLLM(args.model, num_blocks=args.num_blocks, use_compiled_graph=compiled)
    times: dict[int, dict[str, list[float]]] = {b: {"in_process": [], "actors": []} for b in prompts}

    async def run() -> bool:
        await _through_actors(llm, prompts[min(prompts)][:1], 4)  # warm-up
        for _ in range(args.repeats):
            for batch, batch_prompts in prompts.items():
                times[batch]["in_process"].append(_in_process(offline, batch_prompts, args.steps))
                times[batch]["actors"].append(await _through_actors(llm, batch_prompts, args.steps))
        return (await llm.stats()).compiled_graph

    try:
        used = asyncio.run(run())
    finally:
        llm.shutdown()
    medians = {b: {k: statistics.median(v) for k, v in t.items()} for b, t in times.items()}
    return {"compiled_graph": used, "step_ms": medians}


def run_actor_bench(args: argparse.Namespace) -> dict[str, Any]:
    from cadenza.actors.llm import LLM
    from cadenza.models.loader import read_model

    _, cfg = read_model(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    prompts = {b: _workload(b, args.prompt_len, cfg.vocab_size, args.seed + b) for b in batches}
    offline = LLM(args.model, num_blocks=args.num_blocks)
    _in_process(offline, prompts[min(prompts)][:1], 4)  # warm-up
    result: dict[str, Any] = {"model": args.model, "steps": args.steps, "repeats": args.repeats}
    for name, compiled in (("actor_calls", False), ("compiled_graph", True)):
        run = compare(args, offline, prompts, compiled)
        result[name] = {
            "used": run["compiled_graph"] == compiled,
            "batches": {
                str(b): {
                    "in_process_step_ms": t["in_process"],
                    "actors_step_ms": t["actors"],
                    "overhead": t["actors"] / t["in_process"] - 1,
                }
                for b, t in run["step_ms"].items()
            },
        }
    return report(result, args.output)
