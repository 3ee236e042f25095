"""EngineConfig's checks of its own values (config.py calls check_config where a config is made):
each raises a ValueError that names the setting and what it accepts."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from cadenza.format_names import KV_CACHE_DTYPES

if TYPE_CHECKING:
    from cadenza.config import EngineConfig

EXECUTORS = ("auto", "local", "ray")
KV_TRANSPORTS = ("auto", "ipc", "nixl", "object_store")
SHARED_KV_TRANSPORTS = ("ipc", "nixl")  # those whose workers allocate their caches shareable
# NIXL's Python packages: the meta package, or one of its builds installed by name.
NIXL_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")
# The caps on the lists a request sends to edit the logits (RequestLimits fields of these names).
LOGIT_LIST_LIMITS = ("max_logit_bias", "max_allowed_token_ids", "max_bad_words", "max_bad_word_tokens")


def check_config(config: EngineConfig) -> None:  # noqa: C901 - one flat list of independent checks
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {config.kv_cache_dtype!r}")
    if config.block_size < 1 or config.block_size & (config.block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {config.block_size}")
    if config.num_blocks is not None and config.num_blocks < 1:
        raise ValueError(f"num_blocks must be positive, got {config.num_blocks}")
    if config.kv_cache_memory <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {config.kv_cache_memory}")
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {config.gpu_memory_utilization}")
    if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
    if config.tensor_parallel_size < 1 or config.pipeline_parallel_size < 1:
        raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
    if config.max_local_prefill_tokens < 0 or config.max_engine_restarts < 0 or config.kv_lease_s <= 0:
        raise ValueError("max_local_prefill_tokens and max_engine_restarts must be >= 0, kv_lease_s > 0")
    if config.kv_transport not in KV_TRANSPORTS:
        raise ValueError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {config.kv_transport!r}")
    if config.kv_transport == "nixl" and not any(importlib.util.find_spec(name) for name in NIXL_PACKAGES):
        raise ValueError("kv_transport nixl needs NIXL installed: pip install nixl (or nixl-cu12 on a CPU host)")
    if config.executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {config.executor!r}")
    if config.executor == "local" and config.world_size > 1:
        raise ValueError("executor='local' runs one worker: tensor_parallel_size = pipeline_parallel_size = 1")
    if config.async_scheduling and (config.world_size > 1 or config.speculative_config is not None):
        raise ValueError(
            "async_scheduling needs tensor_parallel_size = pipeline_parallel_size = 1 and no speculative_config"
        )
    if config.scheduling_policy not in ("fcfs", "priority"):
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {config.scheduling_policy!r}")
    limits = ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids", *LOGIT_LIST_LIMITS)
    if any(getattr(config, name) < 0 for name in limits) or config.max_logprobs < -1:
        raise ValueError(f"{', '.join(limits)} must be non-negative, max_logprobs >= -1 (-1: no cap)")
    if config.session_pin_ttl_s < 0 or not 0 <= config.max_pinned_fraction < 1:
        raise ValueError("session_pin_ttl_s must be >= 0 and max_pinned_fraction in [0, 1)")
    if config.request_timeout_s is not None and config.request_timeout_s <= 0:
        raise ValueError(f"request_timeout_s must be positive, got {config.request_timeout_s}")
    if config.priority_aging_s < 0:
        raise ValueError(f"priority_aging_s must be >= 0 (0: no aging), got {config.priority_aging_s}")
    if not 1 <= config.max_pinned_sessions_per_tenant <= config.max_pinned_sessions:
        raise ValueError("max_pinned_sessions_per_tenant must be in [1, max_pinned_sessions]")
    if config.grammar_mask_timeout_s is not None and config.grammar_mask_timeout_s <= 0:
        raise ValueError(f"grammar_mask_timeout_s must be > 0 (None: no limit), got {config.grammar_mask_timeout_s}")
