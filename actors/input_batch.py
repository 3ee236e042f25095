"""The runner's side of the requests: each one's state, kept in step with the scheduler by the
deltas of its SchedulerOutput, and the flattened (varlen) batch a step builds from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cadenza.actors.logit_edits import LogitEdits
from cadenza.actors.sampler import SamplingRow
from cadenza.actors.spec_proposal import ProposalInput
from cadenza.actors.varlen_batch import Chunk, build_batch
from cadenza.kernels.attention.metadata import AttentionMetadata
from cadenza.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput
from cadenza.sampling_params import SamplingParams

# Stands in for a pending token in a batch's host-built input ids until fed_ids writes it.
PLACEHOLDER_ID = 0


@dataclass(slots=True)
class RunnerRequest:
    """The runner's copy of a request, kept in step with the scheduler by deltas."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: list[int] = field(default_factory=list)  # drafts verified this step
    # Scheduling ahead: the last sampled token is known only on the device so far (the
    # runner's previous DeviceSamples); it follows token_ids, and a step feeds it from there.
    pending: bool = False
    edits: LogitEdits | None = None  # logit_bias, allowed_token_ids, bad_words: made once, on arrival

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_known(self) -> int:
        return len(self.token_ids) + self.pending + len(self.spec_token_ids)

    def known_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the known tokens, a placeholder for the pending one, then the
        drafts, without copying the whole context each step."""
        n = len(self.token_ids)
        tail = [PLACEHOLDER_ID] * self.pending + self.spec_token_ids
        return self.token_ids[start:end] + tail[max(start - n, 0) : max(end - n, 0)]

    def sampling_row(
        self, eos_token_ids: tuple[int, ...], new_tokens: list[int] | None = None, mask: torch.Tensor | None = None
    ) -> SamplingRow:
        """How the request samples next, with new_tokens (sampled but not yet appended) as output."""
        eos = () if self.params.ignore_eos else eos_token_ids
        stop_ids = (*eos, *self.params.stop_token_ids)
        outputs = self.output_ids + (new_tokens or [])
        prompt = self.token_ids[: self.num_prompt_tokens]
        return SamplingRow(self.params, prompt, outputs, stop_ids, mask, self.edits)

    @classmethod
    def from_new(cls, new: NewRequestData) -> RunnerRequest:
        return cls(
            new.req_id,
            list(new.token_ids),
            new.num_prompt_tokens,
            new.sampling_params,
            list(new.block_ids),
            new.num_computed_tokens,
            edits=LogitEdits.of(new.sampling_params) if new.sampling_params.edits_logits else None,
        )


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    reqs: list[RunnerRequest]
    ends: list[int]  # each request's computed length after this step
    sample_rows: list[int]  # flat token indices whose logits the sampling requests use
    sampling: list[RunnerRequest]  # one row each, or k + 1 rows when verifying k drafts
    fed_rows: list[int]  # flat rows holding a placeholder for a token still on the device
    fed_reqs: list[str]  # whose pending token each fed row takes

    def proposal_inputs(
        self, out: ModelRunnerOutput, num_spec: dict[str, int], eos_token_ids: tuple[int, ...]
    ) -> list[ProposalInput]:
        """Every request of the step (a draft model keeps its KV in step with all of them)."""
        inputs = []
        for req, end in zip(self.reqs, self.ends, strict=True):
            new = out.sampled.get(req.req_id, [])
            known = req.token_ids + new
            valid = len(known) - 1 if new else end
            k = num_spec.get(req.req_id, 0) if new else 0
            row = req.sampling_row(eos_token_ids, new)
            inputs.append(ProposalInput(req.req_id, known, req.block_ids, valid, k, row))
        return inputs


class InputBatch:
    """The requests the runner holds, by id, and the batch each step computes over them."""

    def __init__(self, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.requests: dict[str, RunnerRequest] = {}

    def update(self, so: SchedulerOutput, stopped: set[str]) -> None:
        """Drop, add, then extend, in that order: a finished id may come back new in the same
        step. A request in `stopped` (ended here, scheduling ahead) takes no deltas."""
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.new_requests:
            self.requests[new.req_id] = RunnerRequest.from_new(new)
        for delta in so.cached_requests:
            if delta.req_id in stopped:
                continue
            state = self.requests[delta.req_id]
            state.block_ids.extend(delta.new_block_ids)
            state.token_ids.extend(delta.new_token_ids)
            state.num_computed_tokens = delta.num_computed_tokens
        for rid in so.num_scheduled_tokens.keys() - stopped:
            self.requests[rid].spec_token_ids = so.scheduled_spec_tokens.get(rid, [])

    def build(self, scheduled: dict[str, int]) -> Batch:
        """The step's batch; a pending token's row holds PLACEHOLDER_ID, named in fed_rows."""
        # Decodes (one query token) first: attention batches them in one op.
        order = sorted(scheduled, key=lambda rid: scheduled[rid] != 1)
        reqs = [self.requests[rid] for rid in order]
        chunks, sample_rows, sampling = [], [], []
        fed_rows, fed_reqs = [], []
        num_tokens = 0
        for req in reqs:
            start, end = req.num_computed_tokens, req.num_computed_tokens + scheduled[req.req_id]
            chunks.append(Chunk(req.known_slice(start, end), start, req.block_ids))
            if req.pending and start <= len(req.token_ids) < end:
                fed_rows.append(num_tokens + len(req.token_ids) - start)
                fed_reqs.append(req.req_id)
            num_tokens += end - start
            if end == req.num_known:  # caught up with the known tokens: sample (and verify drafts)
                sample_rows += range(num_tokens - len(req.spec_token_ids) - 1, num_tokens)
                sampling.append(req)
        ids, positions, meta = build_batch(chunks, self.block_size, self.device)
        ends = [c.end for c in chunks]
        return Batch(ids, positions, meta, reqs, ends, sample_rows, sampling, fed_rows, fed_reqs)

    def advance(self, scheduled: dict[str, int]) -> None:
        """The step ran: its tokens are computed."""
        for rid, n in scheduled.items():
            self.requests[rid].num_computed_tokens += n
