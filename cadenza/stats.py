"""What an engine reports about itself (`/stats`, `/metrics`, benchmarks): msgspec Structs, so
they cross actor boundaries as they are and the gateway reads them without the engine."""

from __future__ import annotations

import bisect
import itertools

import msgspec


class BlockPoolStats(msgspec.Struct):
    """The KV block pool and its prefix cache since start."""

    num_blocks: int
    num_free_blocks: int
    usage: float  # fraction of blocks referenced by some request
    queries: int  # prompt tokens looked up in the prefix cache
    hits: int  # of those, tokens found
    evictions: int  # cached blocks whose hash was dropped for reuse
    # Blocks ever handed out (a high-water mark): the part of the pool whose KV memory the
    # workers have touched; the rest of a lazily backed pool is not resident.
    num_touched_blocks: int = 0


class SpecDecodeStats(msgspec.Struct):
    """Speculative decoding since start: verification steps, drafts and accepted drafts,
    and accepted_per_position[j]: how often the draft at position j was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_draft_tokens - len(self.accepted_per_position)
        self.accepted_per_position += [0] * max(grow, 0)
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


# vLLM's buckets for tokens per engine step (its iteration_tokens_total histogram).
STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class StepTokenStats(msgspec.Struct):
    """Tokens scheduled per engine step since start, as a histogram: counts[i] steps of at most
    STEP_TOKEN_BUCKETS[i] tokens (and above the one before), the last count past them all."""

    counts: list[int] = []
    total_tokens: int = 0
    num_steps: int = 0

    def record(self, tokens: int) -> None:
        if not tokens:  # a step that ran nothing (all waiting on outputs) is no iteration
            return
        if not self.counts:
            self.counts = [0] * (len(STEP_TOKEN_BUCKETS) + 1)
        self.counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, tokens)] += 1
        self.total_tokens += tokens
        self.num_steps += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, steps at or below it) per bucket, "+Inf" last: Prometheus's histogram shape."""
        counts = self.counts or [0] * (len(STEP_TOKEN_BUCKETS) + 1)
        bounds = [str(float(b)) for b in STEP_TOKEN_BUCKETS] + ["+Inf"]
        return list(zip(bounds, itertools.accumulate(counts), strict=True))


class EngineStats(msgspec.Struct):
    """The scheduler and its KV block pool, and how the weights are kept: `weights` the
    format ("gguf" for a GGUF's stored types, "int4-g32", "bf16", ...), `dtype` what
    dtype="auto" resolved to on this device, `compute_dtype` the activations' and KV's,
    `weight_bytes` the resident weights' size (model.weight_bytes(); 0 where the engine does
    not hold the model and its owner has not reported it)."""

    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache: BlockPoolStats
    spec_decode: SpecDecodeStats | None = None
    weights: str = ""
    dtype: str = ""
    compute_dtype: str = ""
    weight_bytes: int = 0
    num_pinned_blocks: int = 0  # held for conversations between their turns (session pins)
    step_tokens: StepTokenStats | None = None  # tokens per step (None: an engine that does not count)


class KVTransferStats(msgspec.Struct):
    """Hand-overs since start: blocks written on decode engines, blocks they already held,
    bytes written, seconds the requests waited for them, hand-overs that fell back to
    recomputing the prompt on the decode engine, and requests whose prefill engine died."""

    num_handoffs: int = 0
    num_blocks_imported: int = 0
    num_blocks_skipped: int = 0
    # Of the blocks exported, those that moved while their prompt's prefill still ran (a part
    # that did not complete the prompt's cached run): the hand-over overlapped with compute.
    num_blocks_streamed: int = 0
    # Of the blocks imported, those a decode engine copied straight out of the prefill engine's
    # shared cache (the `ipc` transport); the rest came through Ray's object store.
    num_blocks_pulled: int = 0
    num_bytes: int = 0
    # Disaggregation: from the first token to the last block filed (what the decode leg waits
    # for); Serve's pulls: the whole pull.
    seconds: float = 0.0
    num_fallbacks: int = 0
    num_prefill_failures: int = 0  # requests whose prefill engine died: computed on the decode engine
    num_decode_resumes: int = 0  # requests whose decode engine died: resumed on another


class ServingStats(msgspec.Struct, kw_only=True):
    """What an engine client's stats() answers: the engine's own, and how it runs."""

    engine: EngineStats
    num_workers: int  # worker actors (0 when the engine runs in the caller's process)
    worker_pids: list[int]
    num_worker_restarts: int
    num_steps: int
    compiled_graph: bool  # steps run as a Ray Compiled Graph (else plain actor calls)
    engine_pid: int
    # Where the model runs: "local" (the engine's own process), "ray" (worker actors) or
    # "in_process" (the caller's process, no Ray).
    executor: str = "ray"
    num_engine_restarts: int = 0  # engine actors AsyncLLM replaced after they died
    # Prefill/decode disaggregation (actors/disaggregated.py): the KV hand-overs, and each
    # engine's own stats by role ("prefill" / "decode"); None and empty otherwise.
    kv_transfer: KVTransferStats | None = None
    roles: list[tuple[str, ServingStats]] = []
