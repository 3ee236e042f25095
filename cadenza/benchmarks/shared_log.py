"""What the shared response log (gateway/shared_log.py) adds to each event under Serve: the
time from an event's append to the log's acknowledgement, which a client waits before it sees
the event (write-through). Streams of `--events` token-sized events each, `--rate` events a
second per stream, for each count in `--streams`, through a real log actor on a local Ray
instance, flushed as a replica flushes (group commit). Compare the figures with a token's
time (a decode step) on the same host.

    cadenza bench shared-log > docs/bench/shared_log.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from typing import Any

import ray

from cadenza.actors.local_ray import init_local_ray
from cadenza.gateway.log_messages import ReissueSpec
from cadenza.gateway.mirrored_logs import MirroredLogs, SharedLogClient
from cadenza.gateway.settings import GatewaySettings

# A token's event as the Responses API sends it (an output_text.delta with its extras).
DELTA = {
    "type": "response.output_text.delta", "output_index": 0, "item_id": "msg_" + "0" * 32,
    "content_index": 0, "delta": " word", "logprobs": [], "cadenza": {"token_ids": [1234]},
}  # fmt: skip


def add_shared_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--streams", default="1,8,32", help="concurrent streams, comma-separated")
    parser.add_argument("--events", type=int, default=200, help="events per stream")
    parser.add_argument("--rate", type=float, default=100.0, help="events a second per stream")


async def _stream(logs: MirroredLogs, n: int, events: int, rate: float, waits: list[float]) -> None:
    spec = ReissueSpec(b"{}", None, 0, time.time())
    log = logs.open(f"resp_bench_{os.getpid()}_{n}_{time.monotonic_ns()}", None, spec)
    for _ in range(events):
        start = time.perf_counter()
        log.append(DELTA)
        await log.wait_durable(log.count)
        waits.append(time.perf_counter() - start)
        await asyncio.sleep(max(0.0, 1 / rate - (time.perf_counter() - start)))
    log.finish()


async def _run(args: argparse.Namespace, client: SharedLogClient) -> list[dict[str, Any]]:
    s = GatewaySettings()
    logs = MirroredLogs(s.response_log_bounds, client, f"bench-{os.getpid()}", s.response_log_flush_s)
    logs.start()
    results = []
    for streams in (int(n) for n in args.streams.split(",")):
        waits: list[float] = []
        await asyncio.gather(*(_stream(logs, i, args.events, args.rate, waits) for i in range(streams)))
        waits.sort()
        results.append({
            "streams": streams,
            "events": len(waits),
            "ack_wait_ms_p50": 1e3 * statistics.median(waits),
            "ack_wait_ms_p99": 1e3 * waits[int(0.99 * (len(waits) - 1))],
            "ack_wait_ms_mean": 1e3 * statistics.mean(waits),
        })  # fmt: skip
    return results


def run_shared_log_bench(args: argparse.Namespace) -> None:
    if not ray.is_initialized():
        init_local_ray(2, logging_level="error", namespace="cadenza-bench")  # named: its detached actor
    s = GatewaySettings()
    client = SharedLogClient(f"cadenza-response-log:bench:{os.getpid()}", s.response_log_bounds, 5.0)
    try:
        results = asyncio.run(_run(args, client))
    finally:
        ray.kill(client.actor)
    print(json.dumps({"rate_per_stream": args.rate, "results": results}, indent=1))
