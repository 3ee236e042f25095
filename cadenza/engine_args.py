"""Engine flags shared by every command (`cadenza generate/chat/serve/bench`), and the
EngineConfig keyword arguments they become."""

from __future__ import annotations

import argparse
import json
import os

from cadenza.config import DEFAULT_MODEL, LOGIT_LIST_LIMITS
from cadenza.device import DEVICES
from cadenza.format_names import (
    CPU_GEMM_DTYPES,
    DEFAULT_INT4_GROUP_SIZE,
    DTYPE_CHOICES,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
)
from cadenza.request_limits import (
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_STOP_STRING_CHARS,
    DEFAULT_MAX_STOP_STRINGS,
    DEFAULT_MAX_STOP_TOKEN_IDS,
    RequestLimits,
)
from cadenza.vllm_flags import dtype_value, token_count


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help=f"HF directory, .gguf file, Hub id (org/name) or packaged model name (default: {DEFAULT_MODEL})",
    )
    p.add_argument("--revision", default=None, help="a Hub id's branch, tag or commit (default: main)")
    p.add_argument(
        "--generation-config",
        default="auto",
        help="sampling defaults: auto (the model's generation_config.json), vllm (none), or a folder holding one",
    )
    p.add_argument("--download-dir", default=None, help="the Hub cache to read and fetch into (default: HF_HUB_CACHE)")
    p.add_argument(
        "--dtype", default="auto", type=dtype_value, choices=DTYPE_CHOICES, help="auto: bf16 where native, else fp32"
    )
    p.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATIONS,
        help="none: dense in --dtype; gguf: keep a GGUF's types (the default for .gguf); int8/int4: on load",
    )
    p.add_argument("--quantization-group-size", type=int, default=DEFAULT_INT4_GROUP_SIZE, choices=INT4_GROUP_SIZES)
    p.add_argument(
        "--int8-activations", action="store_true", help="CPU q4/q8 kernels read x rounded to int8 (faster, not exact)"
    )
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: CUDA when a GPU is there, else the CPU")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="auto: the activations' dtype; float16 halves the KV bytes a long-context decode reads",
    )
    p.add_argument(
        "--cpu-gemm-dtype",
        default="auto",
        choices=CPU_GEMM_DTYPES,
        help="CPU prefill / large-batch GEMMs over stored weights; auto: bf16 where native and dtype is bf16",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--gpu-memory-utilization", type=float, default=0.9, help="CUDA: the device's share for weights, steps and KV"
    )
    p.add_argument("--enforce-eager", action="store_true", help="CUDA: no graphs for decode steps")
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule the next step before this one's outputs return (default: on CUDA only)",
    )
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=token_count, default=None, help="2048, 32k (32,000) or 32K (32,768)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's spelling (default on)",
    )
    p.add_argument("--scheduling-policy", default="priority", choices=["fcfs", "priority"])
    p.add_argument("--session-pin-ttl-s", type=float, default=300.0, help="keep a conversation's prefix KV this long")
    p.add_argument("--max-pinned-fraction", type=float, default=0.25, help="the most of the KV pool pins may hold")
    p.add_argument("--max-pinned-sessions", type=int, default=8192, help="the most sessions pinned at once")
    p.add_argument("--max-pinned-sessions-per-tenant", type=int, default=1024, help="the most pinned per tenant")
    p.add_argument(
        "--priority-aging-s", type=float, default=1.0, help="a waiting request gains a priority level per this (0: off)"
    )
    # Request limits (cadenza.request_limits): past them a request is refused before any work.
    p.add_argument("--max-logprobs", type=int, default=DEFAULT_MAX_LOGPROBS)
    p.add_argument("--max-stop-strings", type=int, default=DEFAULT_MAX_STOP_STRINGS)
    p.add_argument("--max-stop-string-chars", type=int, default=DEFAULT_MAX_STOP_STRING_CHARS)
    p.add_argument("--max-stop-token-ids", type=int, default=DEFAULT_MAX_STOP_TOKEN_IDS)
    defaults = RequestLimits(0, 0)
    for name in LOGIT_LIST_LIMITS:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    p.add_argument("--request-timeout-s", type=float, default=None, help="end a request this long after arrival")
    p.add_argument(
        "--grammar-mask-timeout-s",
        type=float,
        default=1.0,
        help="a request whose grammar mask is not ready this long after the forward pass fails alone",
    )
    p.add_argument(
        "--speculative-config",
        type=json.loads,
        default=None,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )


def apply_hub_flags(args: argparse.Namespace) -> None:
    """--revision and --download-dir as the environment the Hub lookup reads
    (cadenza/models/hub.py): the model is resolved in this process, the engine actor and its
    workers, which inherit it."""
    if getattr(args, "revision", None):
        os.environ["CADENZA_HUB_REVISION"] = args.revision
    if getattr(args, "download_dir", None):
        os.environ["HF_HUB_CACHE"] = args.download_dir


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine settings every command shares, from their flags."""
    return dict(
        dtype=args.dtype,
        quantization=args.quantization,
        quantization_group_size=args.quantization_group_size,
        int8_activations=args.int8_activations,
        device=args.device,
        kv_cache_dtype=args.kv_cache_dtype,
        cpu_gemm_dtype=args.cpu_gemm_dtype,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        generation_config=args.generation_config,
        enable_prefix_caching=(
            args.enable_prefix_caching if args.enable_prefix_caching is not None else not args.no_prefix_caching
        ),
        speculative_config=args.speculative_config,
        scheduling_policy=args.scheduling_policy,
        max_logprobs=args.max_logprobs,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_stop_token_ids=args.max_stop_token_ids,
        **{name: getattr(args, name) for name in LOGIT_LIST_LIMITS},
        request_timeout_s=args.request_timeout_s,
        session_pin_ttl_s=args.session_pin_ttl_s,
        max_pinned_fraction=args.max_pinned_fraction,
        max_pinned_sessions=args.max_pinned_sessions,
        max_pinned_sessions_per_tenant=args.max_pinned_sessions_per_tenant,
        priority_aging_s=args.priority_aging_s,
        grammar_mask_timeout_s=args.grammar_mask_timeout_s,
    )
