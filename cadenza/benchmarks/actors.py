"""`cadenza bench actors`: decode step time through the actor runtime vs the in-process
engine, and the per-step timeline of where the difference goes.

Each batch runs B greedy requests with short prompts in lockstep, so the time between one
request's tokens is the engine's decode step. Timestamps are taken where the caller sees the
tokens, so the actor figures include everything the runtime adds. Each executor (`local`:
the model in the engine actor's process; `ray`: worker actors called per step;
`compiled_graph`: worker actors over a Ray Compiled Graph; `local_ahead`, `ray_ahead`: with
async scheduling) is measured against the in-process `LLM` in the same run, alternating,
medians of `repeats`.

The timeline (cadenza.actors.timeline) splits each step into stages stamped in the engine,
the driver and AsyncLLM; with `--websocket` one more stream goes through the gateway app
(uvicorn in a thread of this process, as `cadenza serve` runs it) to a websocket client, which
adds the last stage: AsyncLLM's delta to the frame received.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import random
import statistics
import time
from typing import Any

from cadenza.actors.timeline import STAGES, TimelineRecorder, engine_gap, median_stages
from cadenza.benchmarks.report import free_port, report
from cadenza.outputs import RequestMetrics
from cadenza.sampling_params import SamplingParams

EXECUTORS = {"local": dict(executor="local"), "ray": dict(executor="ray", use_compiled_graph=False)}
EXECUTORS["compiled_graph"] = dict(executor="ray", use_compiled_graph=True)
# Async scheduling (one step ahead): the same executors, the next step planned before the
# last one's outputs are back. Against the same in-process LLM, which steps one at a time: an
# LLM scheduling ahead here would put a second OpenMP team in this process and slow both
# (engine_core.model_thread); `cadenza bench offline --async-scheduling` times it alone.
EXECUTORS["local_ahead"] = dict(executor="local", async_scheduling=True)
EXECUTORS["ray_ahead"] = dict(executor="ray", use_compiled_graph=False, async_scheduling=True)


def add_actor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--steps", type=int, default=48, help="decode steps per request")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--executors", default="local,ray", help=f"any of {','.join(EXECUTORS)}")
    p.add_argument(
        "--websocket", action=argparse.BooleanOptionalAction, default=True, help="time one stream via the gateway"
    )
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


async def _through_actors(llm: Any, prompts: list[list[int]], steps: int) -> tuple[float, list[str]]:
    async def one(ids: list[int]) -> tuple[RequestMetrics, str]:
        async for delta in llm.generate({"prompt_token_ids": ids}, _params(steps)):
            last = delta
        return last.metrics[0], last.request_id

    done = await asyncio.gather(*(one(p) for p in prompts))
    return _step_ms([m for m, _ in done], steps), [rid for _, rid in done]


def _timeline(recorder: TimelineRecorder, request_ids: list[str]) -> dict[str, Any]:
    """Median ms per stage over the steady decode steps of these requests (the first, with
    the prefill, is left out), the engine's gap between steps and the step period."""
    rows = [row for rid in request_ids for row in recorder.stages(rid)[1:]]
    steps = [t for t in recorder.steps.values() if t.num_reqs == len(request_ids) and t.num_tokens == len(request_ids)]
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if b.step == a.step + 1]
    gap = 1e3 * statistics.median(engine_gap(a, b) for a, b in pairs) if pairs else None
    period = 1e3 * statistics.median(b.scheduled - a.scheduled for a, b in pairs) if pairs else None
    return {"stages_ms": median_stages(rows), "engine_gap_ms": gap, "step_period_ms": period}


def compare(args: argparse.Namespace, offline: Any, prompts: dict[int, list[list[int]]], executor: str) -> dict:
    """Alternate in-process and actor runs, `repeats` times each, and keep the medians: this
    machine's timing noise is larger than the effect being measured."""
    from cadenza.actors.async_llm import AsyncLLM

    llm = AsyncLLM(args.model, num_blocks=args.num_blocks, **EXECUTORS[executor])
    times: dict[int, dict[str, list[float]]] = {b: {"in_process": [], "actors": []} for b in prompts}
    timelines: dict[int, dict] = {}

    async def run() -> dict:
        await _through_actors(llm, prompts[min(prompts)][:1], 4)  # warm-up
        for _ in range(args.repeats):
            for batch, batch_prompts in prompts.items():
                times[batch]["in_process"].append(_in_process(offline, batch_prompts, args.steps))
                llm.recorder = TimelineRecorder()
                step_ms, rids = await _through_actors(llm, batch_prompts, args.steps)
                times[batch]["actors"].append(step_ms)
                timelines[batch] = _timeline(llm.recorder, rids)  # the last repeat's
        llm.recorder = None
        ws = await _websocket_leg(llm, args.steps) if args.websocket else None
        stats = await llm.stats()
        return {"compiled_graph": stats.compiled_graph, "executor": stats.executor, "websocket": ws}

    try:
        facts = asyncio.run(run())
    finally:
        llm.shutdown()
    medians = {b: {k: statistics.median(v) for k, v in t.items()} for b, t in times.items()}
    return {**facts, "step_ms": medians, "timelines": timelines}


# Asks for more text than `steps` tokens, so the stream runs to max_output_tokens.
WS_PROMPT = "Write a long story about a river, a bridge and a summer storm."


async def _websocket_leg(llm: Any, steps: int) -> dict[str, Any]:
    """One stream through the gateway app on uvicorn (in a thread here) to a websocket client:
    the token interval the client sees and the last stage, AsyncLLM's delta to the frame."""
    import threading

    import uvicorn
    import websockets

    from cadenza.gateway.app import build_app
    from cadenza.gateway.server import uvicorn_config
    from cadenza.gateway.settings import GatewaySettings

    settings = GatewaySettings(port=free_port())
    server = uvicorn.Server(uvicorn_config(build_app(llm, "bench", settings), settings))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        await asyncio.sleep(0.05)
    llm.recorder = TimelineRecorder()
    frames: list[float] = []
    try:
        async with websockets.connect(f"ws://127.0.0.1:{settings.port}/v1/responses", max_size=None) as ws:
            event = {"type": "response.create", "model": "bench", "input": WS_PROMPT, "max_output_tokens": steps}
            await ws.send(json.dumps(event | {"temperature": 0}))
            async for message in ws:
                kind = json.loads(message)["type"]
                if kind == "response.output_text.delta":
                    frames.append(time.monotonic())
                elif kind in ("response.completed", "response.incomplete", "response.failed", "error"):
                    break
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    return _frame_stage(llm.recorder, frames)


def _frame_stage(recorder: TimelineRecorder, frames: list[float]) -> dict[str, Any]:
    """Each frame against the latest delivery before it: the gateway's part of a token."""
    deliveries = sorted(at for per_step in recorder.delivered.values() for at in per_step.values())
    lags = []
    for frame in frames[1:]:
        i = bisect.bisect_right(deliveries, frame)
        if i:
            lags.append(frame - deliveries[i - 1])
    gaps = [b - a for a, b in zip(frames[1:], frames[2:])]
    return {
        "frames": len(frames),
        "gateway_frame_ms": 1e3 * statistics.median(lags) if lags else None,
        "client_token_interval_ms": 1e3 * statistics.median(gaps) if gaps else None,
    }


def run_actor_bench(args: argparse.Namespace) -> dict[str, Any]:
    from cadenza.actors.llm import LLM
    from cadenza.models.loader import read_model

    _, cfg = read_model(args.model)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    prompts = {b: _workload(b, args.prompt_len, cfg.vocab_size, args.seed + b) for b in batches}
    offline = LLM(args.model, num_blocks=args.num_blocks)
    _in_process(offline, prompts[min(prompts)][:1], 4)  # warm-up
    result: dict[str, Any] = {"model": args.model, "steps": args.steps, "repeats": args.repeats}
    result["stages"] = [name for name, *_ in STAGES]
    for name in args.executors.split(","):
        run = compare(args, offline, prompts, name)
        result[name] = {
            "executor": run["executor"],
            "compiled_graph": run["compiled_graph"],
            "websocket": run["websocket"],
            "batches": {
                str(b): {
                    "in_process_step_ms": t["in_process"],
                    "actors_step_ms": t["actors"],
                    "overhead": t["actors"] / t["in_process"] - 1,
                    "timeline": run["timelines"].get(b),
                }
                for b, t in run["step_ms"].items()
            },
        }
    return report(result, args.output)
