"""`cadenza bench serve`: drive a running server the way users feel it.

Over HTTP SSE (/v1/chat/completions) or the Responses websocket, at a fixed concurrency or
a Poisson arrival rate, with a seeded synthetic workload or prompts from a file. Reports
TTFT, ITL (gaps between streamed chunks, per token) and TPOT (per request, after the first
token) at p50/p90/p99, request and output-token throughput, and goodput: completed
requests per second that met every given SLO. JSON on stdout, optional PNG of the
latency distributions.

After the run it reads the server's /stats and, when the server is on this machine (a
loopback URL), reports the peak and current RSS of the engine, its workers and the gateway,
and of Ray's own processes apart (`memory`, see benchmarks/memory.py); `memory` is null with
`memory_reason` saying why where it cannot be read. It never fails the bench.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import msgspec

from cadenza.benchmarks.memory import serving_memory_report
from cadenza.benchmarks.report import percentiles_ms, report

WORDS = "time river light stone music garden window story number cloud paper summer field voice bridge".split()


@dataclass
class Sample:
    prompt: str
    max_tokens: int


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)  # per token
    output_tokens: int = 0
    latency: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--transport", choices=["http", "ws"], default="http")
    p.add_argument("--model", default=None, help="the served model name (default: ask /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (default: all at once)")
    p.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second instead")
    p.add_argument("--input-words", default="16:128", help="synthetic prompt length in words, lo:hi")
    p.add_argument("--output-len", default="32:128", help="max tokens per request, lo:hi")
    p.add_argument("--dataset", default=None, help="JSONL of {prompt, max_tokens} or plain text lines")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--priority", type=int, default=None, help="sent with every request (lower runs first)")
    p.add_argument(
        "--long-prompt-words",
        type=int,
        default=500,
        help="a mixed workload's prompts of at least this many words are summarized apart (by_prompt)",
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--plot", default=None, help="write a PNG of the latency distributions here")
    p.add_argument(
        "--compare-offline",
        action="store_true",
        help="then run the same prompts on an in-process LLM here and report served / in-process ratios",
    )
    p.add_argument("--offline-model", default=None, help="the in-process model (default: the served model's name)")
    p.add_argument("--output", default=None, help="also write the JSON here")
    p.add_argument(
        "--disaggregation",
        default=None,
        help="NPMD: start a colocated server and an NPMD one here in turn, run the workload on each, "
        "and report both with their ratios (--url is then not used)",
    )
    p.add_argument("--serve-args", default="", help="with --disaggregation: flags for both servers (model, ...)")
    p.add_argument(
        "--split-cpus", type=float, default=None, help="with --disaggregation: CPUs per split engine's worker"
    )


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def make_workload(args: argparse.Namespace) -> list[Sample]:
    rng = random.Random(args.seed)
    out_lo, out_hi = _span(args.output_len)
    if args.dataset:
        samples = []
        with open(args.dataset) as f:
            for line in filter(str.strip, f):
                row = json.loads(line) if line.lstrip().startswith("{") else {"prompt": line.strip()}
                samples.append(Sample(row["prompt"], int(row.get("max_tokens") or rng.randint(out_lo, out_hi))))
        return [samples[i % len(samples)] for i in range(args.num_prompts)]
    in_lo, in_hi = _span(args.input_words)
    return [
        Sample(" ".join(rng.choice(WORDS) for _ in range(rng.randint(in_lo, in_hi))), rng.randint(out_lo, out_hi))
        for _ in range(args.num_prompts)
    ]


async def _http_one(session: Any, args: argparse.Namespace, sample: Sample, result: Result) -> None:
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": sample.prompt}],
        "max_tokens": sample.max_tokens,
        "ignore_eos": True,  # fixed output lengths: what was asked is what is measured
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.priority is not None:
        body["priority"] = args.priority
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with session.post(f"{args.url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            result.error = f"HTTP {r.status}: {(await r.text())[:200]}"
            return
        last = None
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                result.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                last = _tick(result, last, 1)
    result.ok = True


async def _ws_one(session: Any, args: argparse.Namespace, sample: Sample, result: Result) -> None:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.url.replace("http", "ws", 1) + "/v1/responses"
    async with session.ws_connect(url, headers=headers, max_msg_size=0) as ws:
        event = {"type": "response.create", "input": sample.prompt, "max_output_tokens": sample.max_tokens}
        if args.priority is not None:
            event["priority"] = args.priority
        await ws.send_str(json.dumps({**event, "model": args.model}))
        last = None
        async for message in ws:
            ev = json.loads(message.data)
            if ev["type"] == "response.output_text.delta":
                last = _tick(result, last, len(ev.get("cadenza", {}).get("token_ids", [1])))
            elif ev["type"] in ("response.completed", "response.incomplete"):
                result.output_tokens = ev["response"]["usage"]["output_tokens"]
                result.ok = True
                return
            elif ev["type"] in ("error", "response.failed"):
                result.error = json.dumps(ev)[:200]
                return


def _tick(result: Result, last: float | None, tokens: int) -> float:
    now = time.perf_counter()
    if last is None:
        result.ttft = now - result.start
    else:
        result.gaps += [(now - last) / tokens] * tokens
    return now


async def _run(args: argparse.Namespace, workload: list[Sample]) -> tuple[list[Result], float, dict | str]:
    """The results, the elapsed time and the server's /stats after the run (or why not)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    limit = args.concurrency or len(workload)
    gate = asyncio.Semaphore(limit)
    rng = random.Random(args.seed + 1)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if args.model is None:
            async with session.get(f"{args.url}/v1/models", headers=_auth(args)) as r:
                args.model = (await r.json())["data"][0]["id"]
        one = _http_one if args.transport == "http" else _ws_one

        async def request(sample: Sample) -> Result:
            result = Result()
            async with gate:
                result.start = time.perf_counter()
                try:
                    await one(session, args, sample, result)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    result.error = f"{type(e).__name__}: {e}"
                result.latency = time.perf_counter() - result.start
            return result

        start = time.perf_counter()
        tasks = []
        for sample in workload:
            tasks.append(asyncio.ensure_future(request(sample)))
            if args.request_rate:
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - start
        return results, elapsed, await _fetch_stats(session, args)


async def _fetch_stats(session: Any, args: argparse.Namespace) -> dict | str:
    """GET /stats; the reason as a string when it cannot be had."""
    import aiohttp

    try:
        async with session.get(f"{args.url}/stats", headers=_auth(args)) as r:
            if r.status != 200:
                return f"GET /stats answered HTTP {r.status}"
            return await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return f"GET /stats failed: {type(e).__name__}: {e}"


def is_loopback_url(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def memory_section(url: str, stats: dict | str) -> tuple[dict | None, str | None]:
    """(the serving tree's memory report, None), or (None, why there is none)."""
    if isinstance(stats, str):
        return None, stats
    if not is_loopback_url(url):
        return None, f"the server at {url} is not on this machine's loopback: its /proc is not ours to read"
    if not os.path.exists("/proc/self/status"):
        return None, "no /proc on this machine"
    serving = stats.get("engine") if isinstance(stats.get("engine"), dict) else {}
    engine_pid = serving.get("engine_pid")
    if not isinstance(engine_pid, int):
        return None, "/stats carries no engine_pid"
    gateway = stats.get("gateway") if isinstance(stats.get("gateway"), dict) else {}
    engine = serving.get("engine") if isinstance(serving.get("engine"), dict) else {}
    try:
        found = serving_memory_report(
            engine_pid, list(serving.get("worker_pids") or []), gateway.get("gateway_pid"), engine.get("weight_bytes")
        )
    except Exception as e:  # best effort: the latencies above are the bench's point
        return None, f"reading the processes' memory failed: {type(e).__name__}: {e}"
    return msgspec.to_builtins(found), None


def _auth(args: argparse.Namespace) -> dict[str, str]:
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


def summarize(args: argparse.Namespace, results: list[Result], elapsed: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    meets = lambda r: (
        (args.slo_ttft_ms is None or (r.ttft or 0) * 1e3 <= args.slo_ttft_ms)
        and (args.slo_tpot_ms is None or (r.tpot or 0) * 1e3 <= args.slo_tpot_ms)
    )
    output_tokens = sum(r.output_tokens for r in done)
    return {
        "url": args.url,
        "transport": args.transport,
        "model": args.model,
        "num_prompts": len(results),
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "elapsed_s": elapsed,
        "request_throughput": len(done) / elapsed,
        "output_token_throughput": output_tokens / elapsed,
        "goodput": sum(1 for r in done if meets(r)) / elapsed,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "ttft_ms": percentiles_ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": percentiles_ms([g for r in done for g in r.gaps]),
        "tpot_ms": percentiles_ms([r.tpot for r in done if r.tpot is not None]),
        "e2e_ms": percentiles_ms([r.latency for r in done]),
    }


def by_prompt_length(workload: list[Sample], results: list[Result], long_words: int) -> dict[str, Any] | None:
    """Latencies of the short and the long prompts apart (a mixed workload: the short chats'
    inter-token latency is what long prefills disturb); None unless there are both."""
    groups: dict[str, list[Result]] = {"short": [], "long": []}
    for sample, result in zip(workload, results, strict=True):
        if result.ok:
            groups["long" if len(sample.prompt.split()) >= long_words else "short"].append(result)
    if not all(groups.values()):
        return None
    summary: dict[str, Any] = {"long_prompt_words": long_words}
    for name, done in groups.items():
        summary[name] = {
            "completed": len(done),
            "ttft_ms": percentiles_ms([r.ttft for r in done if r.ttft is not None]),
            "itl_ms": percentiles_ms([g for r in done for g in r.gaps]),
        }
    return summary


def plot(path: str, results: list[Result], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if r.ok]
    series = {
        "TTFT (ms)": [r.ttft * 1e3 for r in done if r.ttft is not None],
        "ITL (ms)": [g * 1e3 for r in done for g in r.gaps],
        "TPOT (ms)": [r.tpot * 1e3 for r in done if r.tpot is not None],
    }
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (name, values) in zip(axes, series.items()):
        ax.hist(values, bins=40, color="#4a72b0")
        ax.set_xlabel(name)
        ax.set_ylabel("count")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_serve_bench(args: argparse.Namespace) -> dict[str, Any]:
    if getattr(args, "disaggregation", None):
        from cadenza.benchmarks.disaggregation import run_disaggregation_bench

        return run_disaggregation_bench(args, _one)
    return _one(args)


def _one(args: argparse.Namespace) -> dict[str, Any]:
    if args.compare_offline and args.request_rate:
        raise SystemExit("--compare-offline reproduces a concurrency (or all at once), not --request-rate arrivals")
    workload = make_workload(args)
    results, elapsed, stats = asyncio.run(_run(args, workload))
    summary = summarize(args, results, elapsed)
    summary["by_prompt"] = by_prompt_length(workload, results, args.long_prompt_words)
    summary["memory"], summary["memory_reason"] = memory_section(args.url, stats)
    if args.compare_offline:
        from cadenza.benchmarks.compare_offline import overhead, run_in_process

        model = args.offline_model or args.model
        prompts, lengths = [s.prompt for s in workload], [s.max_tokens for s in workload]
        summary["in_process"] = run_in_process(model, prompts, lengths, args.concurrency) | {"model": model}
        summary["overhead"] = overhead(summary, summary["in_process"])
    if args.plot:
        load = f"concurrency {args.concurrency}" if args.concurrency else f"rate {args.request_rate}/s"
        plot(args.plot, results, f"{summary['model']} over {args.transport}, {load}")
    return report(summary, args.output)
