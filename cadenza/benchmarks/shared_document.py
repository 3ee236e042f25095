"""Conversations over shared documents on two replicas: prefix-cache hit rate and TTFT with
KV pulls between replicas (gateway/peer_kv.py) against session affinity alone.

Eight conversations, two turns each; conversations 0-3 ask about document A and 4-7 about
document B (~1,000 tokens each), and a new conversation goes to the replica home to fewer
sessions, as SessionAffinityRouter sends it, so each document's readers land on both
replicas. With affinity alone each replica computes each document once; with pulls the
second replica to meet a document takes it from the first. Two engines in this process
stand for the replicas (the Serve hop is the same either way and left out); each mode gets
fresh engines.

    cadenza bench shared-document > docs/bench/shared_document.json
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

DOCUMENTS = [
    "A field guide to lighthouses: their lenses, their keepers and the ships they warn. " * 50,
    "A history of the tide tables: how ports measured the sea and printed its calendar. " * 50,
]
REPLY = SamplingParams(temperature=0, max_tokens=16)


def add_shared_document_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--num-blocks", type=int, default=1024)


async def _mode(args: argparse.Namespace, pull: bool, tag: str) -> dict[str, Any]:
    directory = KVDirectory(f"cadenza-kv-directory:bench:{os.getpid()}:{tag}")
    replicas = [
        PeerKVEngine(AsyncLLM(args.model, num_blocks=args.num_blocks), directory, f"r{i}", 64 if pull else 1 << 30, 60)
        for i in range(2)
    ]
    tok = replicas[0].get_tokenizer()
    await timed_turn(
        replicas[0], chat_ids(replicas[0], [{"role": "user", "content": "hi"}]), REPLY
    )  # first-call costs out
    await timed_turn(replicas[1], chat_ids(replicas[1], [{"role": "user", "content": "hi"}]), REPLY)
    homes, ttfts, cached, prompt = [0, 0], [], 0, 0
    conversations = []
    for c in range(args.conversations):
        home = homes.index(min(homes))  # a new session: the replica home to fewer sessions
        homes[home] += 1
        document = DOCUMENTS[c * len(DOCUMENTS) // args.conversations]
        messages = [{"role": "user", "content": f"{document}\nQuestion {c}: what is this about?"}]
        conversations.append((home, messages))
    for _ in range(2):  # two turns each, every conversation's first before any second
        for home, messages in conversations:
            ids = chat_ids(replicas[home], messages)
            ttft, hit, out = await timed_turn(replicas[home], ids, REPLY)
            ttfts.append(ttft)
            cached, prompt = cached + hit, prompt + len(ids)
            messages += [{"role": "assistant", "content": tok.decode(out)}, {"role": "user", "content": "Go on."}]
    pulled = sum(r.transfer.num_blocks_imported for r in replicas)
    for r in replicas:
        r.engine.shutdown()
    ray.kill(directory.actor)
    return {
        "prefix_cache_hit_rate": cached / prompt,
        "mean_ttft_s": statistics.mean(ttfts),
        "median_ttft_s": statistics.median(ttfts),
        "blocks_pulled": pulled,
        "prompt_tokens": prompt,
    }


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    init_local_ray(4, logging_level="error")
    affinity = await _mode(args, pull=False, tag="affinity")
    pulls = await _mode(args, pull=True, tag="pulls")
    return {
        "conversations": args.conversations,
        "documents": len(DOCUMENTS),
        "session_affinity_only": affinity,
        "with_kv_pulls": pulls,
        "mean_ttft_ratio": pulls["mean_ttft_s"] / affinity["mean_ttft_s"],
    }


def run_shared_document_bench(args: argparse.Namespace) -> None:
    machine = {"gemm_gflops": measure_gemm_gflops(), "read_gbps": measure_read_gbps()}
    print(json.dumps({"machine": machine, **asyncio.run(_measure(args))}, indent=1))
