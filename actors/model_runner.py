"""ModelRunner: owns the model and its KV cache, turns a SchedulerOutput into one forward pass
over a flattened (varlen) batch, and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from cadenza.actors.sampler import SamplingRow, prompt_logprobs, sample
from cadenza.kernels.metadata import AttentionMetadata
from cadenza.models.llama import LlamaForCausalLM

from cadenza.messages import HiddenStates, ModelRunnerOutput, NewRequestData, SchedulerOutput, TokenLogprobs
from cadenza.sampling_params import SamplingParams


@dataclass(slots=True)
class RunnerRequest:
    """The runner's copy of a request, kept in step with the scheduler by deltas."""

    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int

    @classmethod
    def from_new(cls, new: NewRequestData) -> RunnerRequest:
        return cls(
            new.req_id,
            list(new.token_ids),
            new.num_prompt_tokens,
            new.sampling_params,
            list(new.block_ids),
            new.num_computed_tokens,
        )


@dataclass(slots=True)
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    reqs: list[RunnerRequest]
    sample_rows: list[int]  # flat token index whose logits each sampling request uses
    sampling: list[RunnerRequest]


def allocate_kv_cache(
    model: LlamaForCausalLM, num_blocks: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed, so never-written slots that a padded gather reads are finite (0 * NaN would leak)."""
    dtype, device = model.norm.dtype, model.norm.device
    caches = []
    for layer in model.layers:  # this pipeline stage's layers, this rank's KV heads
        shape = (num_blocks, block_size, layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
        caches.append((torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)))
    return caches


def pack_hidden(x: torch.Tensor, residual: torch.Tensor) -> HiddenStates:
    # bytes through int16/int32 views: numpy has no bfloat16.
    raw = lambda t: t.contiguous().cpu().view(torch.int16 if t.element_size() == 2 else torch.int32).numpy().tobytes()
    dtype = str(x.dtype).removeprefix("torch.")
    return HiddenStates(shape=list(x.shape), dtype=dtype, hidden=raw(x), residual=raw(residual))


def unpack_hidden(h: HiddenStates, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = getattr(torch, h.dtype)
    load = lambda b: torch.frombuffer(bytearray(b), dtype=dtype).view(h.shape).to(device)
    return load(h.hidden), load(h.residual)


class ModelRunner:
    """One worker's runner. With pipeline stages, a stage before the last returns HiddenStates
    for the next; with tensor parallelism every rank computes and only the driver samples."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        is_driver: bool = True,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.is_driver = is_driver
        self.device = model.norm.device
        self.kv_caches = allocate_kv_cache(model, num_blocks, block_size)
        self.requests: dict[str, RunnerRequest] = {}

    def execute(self, so: SchedulerOutput, previous: HiddenStates | None = None) -> ModelRunnerOutput | HiddenStates:
        self._update_states(so)
        if not so.total_num_scheduled_tokens:
            return ModelRunnerOutput(sampled={})
        batch = self._prepare(so.num_scheduled_tokens)
        with torch.inference_mode():
            result = self._forward(batch, previous)
        for rid, n in so.num_scheduled_tokens.items():
            self.requests[rid].num_computed_tokens += n
        return result

    def _forward(self, batch: Batch, previous: HiddenStates | None) -> ModelRunnerOutput | HiddenStates:
        model = self.model
        if model.is_first_stage:
            x, residual = model.embed(batch.input_ids), None
        elif previous is None:
            raise ValueError("a later pipeline stage needs the previous stage's hidden states")
        else:
            x, residual = unpack_hidden(previous, self.device)
        x, residual = model.run_layers(x, residual, batch.positions, self.kv_caches, batch.meta)
        if not model.is_last_stage:
            return pack_hidden(x, residual)
        hidden = model.final_norm(x, residual)
        out = self._sample(hidden, batch)
        out.prompt_logprobs = self._prompt_logprobs(hidden, batch)
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for new in so.new_requests:
            self.requests[new.req_id] = RunnerRequest.from_new(new)
        for delta in so.cached_requests:
            state = self.requests[delta.req_id]
            state.block_ids.extend(delta.new_block_ids)
            state.token_ids.extend(delta.new_token_ids)
            state.num_computed_tokens = delta.num_computed_tokens

    def _prepare(self, scheduled: dict[str, int]) -> Batch:
        # Decodes (one query token) first: attention batches them in one op.
        order = sorted(scheduled, key=lambda rid: scheduled[rid] != 1)
        reqs = [self.requests[rid] for rid in order]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl, seq_lens, sample_rows, sampling = [0], [], [], []
        bs = self.block_size
        for req in reqs:
            start, end = req.num_computed_tokens, req.num_computed_tokens + scheduled[req.req_id]
            ids += req.token_ids[start:end]
            positions += range(start, end)
            slots += [req.block_ids[p // bs] * bs + p % bs for p in range(start, end)]
            qsl.append(len(ids))
            seq_lens.append(end)
            if end == len(req.token_ids):  # caught up with the known tokens: sample the next
                sample_rows.append(len(ids) - 1)
                sampling.append(req)
        width = max(len(r.block_ids) for r in reqs)
        tables = [r.block_ids + [0] * (width - len(r.block_ids)) for r in reqs]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            num_decodes=sum(1 for r in order if scheduled[r] == 1),
        )
        return Batch(
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, device=dev),
            meta,
            reqs,
            sample_rows,
            sampling,
        )

    def _sample(self, hidden: torch.Tensor, batch: Batch) -> ModelRunnerOutput:
        if not batch.sampling:
            return ModelRunnerOutput(sampled={})
        logits = self.model.compute_logits(hidden[batch.sample_rows]).cpu()
        if not self.is_driver:  # the gather above is collective; sampling is the driver's alone
            return ModelRunnerOutput(sampled={})
        rows = [
            SamplingRow(
                r.params,
                r.token_ids[: r.num_prompt_tokens],
                r.token_ids[r.num_prompt_tokens :],
                self._stop_ids(r.params),
            )
            for r in batch.sampling
        ]
        tokens, logprobs = sample(logits, rows)
        out = ModelRunnerOutput(sampled={}, logprobs={})
        for req, token, lp in zip(batch.sampling, tokens, logprobs, strict=True):
            out.sampled[req.req_id] = [token]
            if lp is not None:
                out.logprobs[req.req_id] = [lp]
        return out

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        eos = () if params.ignore_eos else self.eos_token_ids
        return (*eos, *params.stop_token_ids)

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: Batch) -> dict[str, list[TokenLogprobs]]:
        """Rows at prompt positions p < num_prompt - 1 predict prompt token p + 1."""
        result: dict[str, list[TokenLogprobs]] = {}
        # Every TP rank takes the same branches: compute_logits is a collective.
        qsl = batch.meta.query_start_loc
        for i, req in enumerate(batch.reqs):
            k = req.params.prompt_logprobs
            start = req.num_computed_tokens
            stop = min(start + qsl[i + 1] - qsl[i], req.num_prompt_tokens - 1)
            if k is None or start >= stop:
                continue
            logits = self.model.compute_logits(hidden[qsl[i] : qsl[i] + stop - start]).cpu()
            result[req.req_id] = prompt_logprobs(logits, req.token_ids[start + 1 : stop + 1], k)
        return result
