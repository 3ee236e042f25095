"""Request: the scheduler's view of one sequence."""

from __future__ import annotations

import enum
import time
from collections import deque

from cadenza.messages import EngineRequest
from cadenza.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class Request:
    """Token state of one sequence. `num_computed_tokens` chases `num_tokens`: prefill chunks,
    prefix-cache hits and decode steps are all "compute the next N tokens"."""

    def __init__(self, req: EngineRequest, eos_token_ids: tuple[int, ...], arrival_seq: int) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.params: SamplingParams = req.sampling_params
        self.priority = req.priority
        self.rank: float = req.priority  # the queues' order: the priority, aged (aged_rank)
        self.arrival_time = req.arrival_time or time.time()
        self.arrival_seq = arrival_seq  # ties broken by admission order
        self.cache_salt = req.cache_salt
        self.prefix_leader = req.prefix_leader
        self.session_id = req.session_id
        self.eos_token_ids = () if self.params.ignore_eos else eos_token_ids
        self.output_token_ids: list[int] = list(req.output_token_ids)  # non-empty: resumed
        self.num_computed_tokens = 0  # by steps whose outputs came back
        # Steps scheduled ahead of their outputs (async scheduling), oldest first: (tokens
        # computed, whether it samples). Empty when steps run one at a time.
        self.in_flight: deque[tuple[int, bool]] = deque()
        self.num_sent_tokens = 0  # tokens the model runners hold for this request
        self.queue_time: float | None = None  # arrival to first admission, seconds
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_logprobs = 0  # prompt positions whose logprobs were already reported
        self.spec_token_ids: list[int] = []  # drafts for the next step, verified as extra tokens
        self.num_drafts = 0  # steps that verified drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens computed once the steps in flight are done."""
        return self.num_computed_tokens + sum(n for n, _ in self.in_flight)

    @property
    def num_placeholders(self) -> int:
        """Output tokens the steps in flight will sample, not yet known here."""
        return sum(samples for _, samples in self.in_flight)

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens or 1 << 62

    @property
    def sort_key(self) -> tuple[float, int]:
        """Lower runs first: (rank, arrival). FCFS requests all carry priority 0."""
        return (self.rank, self.arrival_seq)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def check_stop(self, max_model_len: int) -> bool:
        """Decide, after a token was appended, whether the request is done; record why."""
        last = self.output_token_ids[-1]
        produced = len(self.output_token_ids)
        if ends_on_token(last, produced, self.params, self.eos_token_ids):
            return self._finish("stop", None if last in self.eos_token_ids else last)
        if produced >= self.max_tokens or self.num_tokens >= max_model_len:
            return self._finish("length", None)
        return False

    def _finish(self, reason: str, stop_reason: int | str | None) -> bool:
        self.finish_reason, self.stop_reason = reason, stop_reason
        return True


def aged_rank(priority: int, enqueued_at: float, aging_s: float) -> float:
    """A request's place in the queues when its priority improves by one level per aging_s
    seconds waited (0: never; the rank is the priority). At time t its aged priority is
    priority - (t - enqueued_at) / aging_s; every waiting request ages at the same rate, so
    ordering by priority * aging_s + enqueued_at is the aged order at every t: a rank fixed
    once keeps both queues sorted, and a preempted request keeps the age it had earned.
    NOTE: the bound this buys: no request enqueued more than (priority - p) * aging_s after
    it, at priority p, goes ahead of it, so with priorities bounded it is admitted."""
    return priority * aging_s + enqueued_at if aging_s else priority


def ends_on_token(token: int, num_output: int, params: SamplingParams, eos_token_ids: tuple[int, ...]) -> bool:
    """Whether the request's num_output-th output token, `token`, ends it: an EOS (unless
    ignore_eos) or one of its stop_token_ids, once min_tokens are out. The scheduler decides
    with it, and a runner that samples ahead stops computing a request on the same rule."""
    if num_output < params.min_tokens:
        return False
    return (token in eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids
