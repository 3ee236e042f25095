"""A conversation the router moves to another replica: time to first token of its next turn
where its prefix is cached (the same replica), recomputed (another replica, no pull) and pulled
from the replica that cached it (gateway/peer_kv.py: the KV directory, an export, an import),
all in one run. Each figure is the median of `--reps`; a rep's cache salt keeps its prefix
apart from the others', so every recompute and every pull starts from nothing.

    cadenza bench moved-session > docs/bench/moved_session.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
from typing import Any

import ray

from cadenza.actors.async_llm import AsyncLLM
from cadenza.actors.local_ray import init_local_ray
from cadenza.benchmarks.offline import measure_gemm_gflops, measure_read_gbps
from cadenza.benchmarks.replica_turns import chat_ids, timed_turn
from cadenza.config import DEFAULT_MODEL
from cadenza.gateway.kv_directory import KVDirectory
from cadenza.gateway.peer_kv import PeerKVEngine
from cadenza.sampling_params import SamplingParams

HISTORY = [{"role": "user", "content": "Here is a long document about lighthouses. " * 60}]
FIRST_TURN = SamplingParams(temperature=0, max_tokens=16)
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1)


def add_moved_session_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument(
        "--kv-transport", default="ipc", choices=("ipc", "nixl", "object_store"),
        help="how the pull moves the blocks (ipc: what Serve replicas on one node use; nixl: needs NIXL)",
    )  # fmt: skip


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    # Three engines of one CPU each: more logical CPUs than AsyncLLM's own instance would take.
    init_local_ray(4, logging_level="error")
    directory = KVDirectory(f"cadenza-kv-directory:bench:{os.getpid()}")
    engines = [AsyncLLM(args.model, num_blocks=args.num_blocks, kv_transport=args.kv_transport) for _ in range(3)]
    home, other, puller = engines
    home_peer = PeerKVEngine(home, directory, "home", min_tokens=64, timeout_s=60)
    pulling = PeerKVEngine(puller, directory, "moved", min_tokens=64, timeout_s=60)
    first_ids = chat_ids(home, HISTORY)
    reply = home.get_tokenizer().decode((await timed_turn(home_peer, first_ids, FIRST_TURN, "warm"))[2])
    follow_up = [{"role": "assistant", "content": reply}, {"role": "user", "content": "Summarise it."}]
    turn = chat_ids(home, [*HISTORY, *follow_up])
    for engine in (other, pulling):  # first-call costs out of the figures
        await timed_turn(engine, turn[:32], ONE_TOKEN, "warm")
    cached, recomputed, moved = [], [], []
    for rep in range(args.reps):
        salt = f"rep-{rep}"
        await timed_turn(home_peer, first_ids, FIRST_TURN, salt)  # the first turn, cached (and published) at home
        # Pulled before the home runs (and so holds) the turn itself.
        moved.append(await timed_turn(pulling, turn, ONE_TOKEN, salt))
        cached.append(await timed_turn(home_peer, turn, ONE_TOKEN, salt))
        recomputed.append(await timed_turn(other, turn, ONE_TOKEN, salt))
    for engine in engines:
        engine.shutdown()
    ray.kill(directory.actor)
    median = lambda runs: statistics.median(r[0] for r in runs)  # noqa: E731
    return {
        "prompt_tokens": len(turn),
        "cached_tokens": {"same_replica": cached[-1][1], "recomputed": recomputed[-1][1], "pulled": moved[-1][1]},
        "same_tokens_pulled_as_cached": all(m[2] == c[2] for m, c in zip(moved, cached, strict=True)),
        "ttft_cached_s": median(cached),
        "ttft_recomputed_s": median(recomputed),
        "ttft_pulled_s": median(moved),
        "pulled_over_recomputed": median(moved) / median(recomputed),
        "pull_s_mean": pulling.transfer.seconds / max(pulling.transfer.num_handoffs, 1),
        "kv_transport": args.kv_transport,
        "blocks_pulled": pulling.transfer.num_blocks_imported,
        "blocks_copied_from_a_shared_cache": pulling.transfer.num_blocks_pulled,
        "bytes_pulled": pulling.transfer.num_bytes,
        "reps": args.reps,
    }


def run_moved_session_bench(args: argparse.Namespace) -> None:
    machine = {"gemm_gflops": measure_gemm_gflops(), "read_gbps": measure_read_gbps()}
    print(json.dumps({"machine": machine, **asyncio.run(_measure(args))}, indent=1))
