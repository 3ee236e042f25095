"""What LLM.generate returns; shaped like vLLM's RequestOutput so users can switch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position's logprobs: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    queue_time: float | None = None  # engine-side: arrival to first scheduling
    # Speculative decoding so far: verification steps that had drafts, drafts verified, and
    # drafts the target accepted (each accepted draft is a token this sequence got for free).
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Prefill/decode disaggregation: (start, end) wall-clock seconds of the request's KV
    # hand-over between engines (actors/disaggregated.py), on the first output after it.
    kv_handoff: tuple[float, float] | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafts over drafts verified; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Speculative decoding: how many of these tokens were accepted drafts (a streamed delta:
    # those of the step(s) it covers; a final output: the sequence's total).
    num_accepted_tokens: int = 0

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: list[RequestMetrics] = field(default_factory=list)
