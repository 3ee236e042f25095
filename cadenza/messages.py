"""Typed messages between the engine's parts: msgspec Structs. Actor methods take and return
them as they are; cadenza.actors.codec makes them msgpack on the wire between actors."""

from __future__ import annotations

from typing import Literal

import msgspec

from cadenza.config import EngineConfig
from cadenza.sampling_params import SamplingParams


class Refusal(msgspec.Struct, frozen=True):
    """Why the engine would not queue a request, typed across the actor boundary, so the client
    raises the matching error rather than guessing from a string: `invalid` is the request's
    own fault (ValueError, HTTP 400), `dead` the engine's (it stopped serving and says why:
    EngineDeadError, HTTP 503)."""

    kind: Literal["invalid", "dead"]
    message: str


class EngineRequest(msgspec.Struct, kw_only=True):
    """A tokenized request entering the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    priority: int = 0
    # Mixed into every block hash so tenants that must not share KV never do.
    cache_salt: str | None = None
    # n > 1: followers wait for the leader's prompt and then share its full KV blocks.
    prefix_leader: str | None = None
    # The conversation this request is a turn of: its prefix blocks are pinned after it
    # finishes, for the engine's session_pin_ttl_s (actors/session_pins.py).
    session_id: str | None = None
    # Outputs already sampled elsewhere (a prefill engine's first token): the request resumes
    # after them as a preempted one would, so max_tokens, penalties and seeded draws (keyed by
    # output position) go on exactly where they left off.
    output_token_ids: list[int] = []


class NewRequestData(msgspec.Struct, kw_only=True):
    """Everything a runner needs about a request it does not hold yet (new or resumed)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs are non-empty after preemption)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, kw_only=True):
    """Delta for a request the runner already holds."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Tokens sampled since the runner last saw this request. Runners never append their own
    # samples: only one rank samples, and every rank learns the tokens from here.
    new_token_ids: list[int] = []


class SchedulerOutput(msgspec.Struct, kw_only=True):
    """One step's plan: which requests compute how many of their next tokens."""

    new_requests: list[NewRequestData] = []
    cached_requests: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    # Runners drop their state for these (finished, aborted or preempted since the last step).
    finished_req_ids: list[str] = []
    # Speculative decoding: drafts scheduled as extra tokens of their request (verified in
    # this pass), and how many drafts to propose for each request after this step.
    scheduled_spec_tokens: dict[str, list[int]] = {}
    num_spec_tokens: dict[str, int] = {}


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprobs at one position: the chosen token first, then the top-k alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # 1-based rank of the chosen token in the distribution


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """What a runner computed in one step."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = {}
    # Prompt logprobs for the prompt positions computed this step (chunked prefill sends parts).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # Speculative decoding: the proposer's drafts for each request's next step.
    draft_token_ids: dict[str, list[int]] = {}
    # Requests whose own input broke their part of the step (sampling, logprobs): id -> why.
    # They fail alone; the rest of the batch is unharmed.
    failed: dict[str, str] = {}
    # When the driver began the step, finished its forward pass and had the step's output
    # (time.monotonic(), one clock for every process of a machine): the step's timeline.
    timing: list[float] = []

    @classmethod
    def empty(cls) -> ModelRunnerOutput:
        """A step that sampled nothing: bookkeeping only, or a rank other than the driver."""
        return cls(sampled={})


class HiddenStates(msgspec.Struct, kw_only=True):
    """What one pipeline stage hands the next through the executor: the shape and dtype of the
    hidden states and residual it sent over torch.distributed (actors/stage_link.py)."""

    shape: list[int]
    dtype: str


class WorkerSpec(msgspec.Struct, kw_only=True):
    """What a worker actor is created with: the engine's config and its place in the grid."""

    config: EngineConfig
    num_blocks: int
    eos_token_ids: list[int]
    tp_rank: int
    pp_rank: int
    num_threads: int


class EngineOutput(msgspec.Struct, kw_only=True):
    """Per-request delta of one step, as the engine hands it to its client."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = []
    new_prompt_logprobs: list[TokenLogprobs] = []
    finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    error: str | None = None  # why, when finish_reason is "error" (e.g. a worker died)
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    queue_time: float | None = None  # seconds from arrival to first scheduling, once known
    # Speculative decoding this step: drafts verified and how many of them the target accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    step: int = 0  # the engine step that produced it (its StepTiming's number)


class StepTiming(msgspec.Struct, array_like=True):
    """Where one engine step's time went: time.monotonic() stamps (the same clock in every
    process of a machine), in the order they happen. The engine stamps `scheduled` (schedule()
    begins), `dispatched` (the step handed to the executor), `returned` (its output back) and
    `published` (the scheduler updated, the outputs ready for the client); the driver stamps
    `started`, `forwarded` (forward pass done, sampling begins) and `sampled`. `received` is
    the client's: when its output batch arrived (0 until then)."""

    step: int
    num_reqs: int
    num_tokens: int
    scheduled: float
    dispatched: float
    started: float
    forwarded: float
    sampled: float
    returned: float
    published: float
    received: float = 0.0


class OutputBatch(msgspec.Struct, kw_only=True):
    """Every delta published after the client's acknowledged batch, up to batch `last`, and
    the timelines of the steps that produced them."""

    last: int
    outputs: list[EngineOutput]
    timings: list[StepTiming] = []
