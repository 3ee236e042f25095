"""ModelRunner: owns the model and its KV cache, turns a SchedulerOutput into one forward pass
over a flattened (varlen) batch, and samples."""

from __future__ import annotations

import math
import mmap
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from cadenza.actors.cuda_graphs import DecodeGraphs, GraphSettings, capture_sizes
from cadenza.actors.device_copy import take_rows, to_device
from cadenza.actors.device_samples import DeviceSamples, PendingOutput, fed_ids
from cadenza.actors.grammar_matchers import GrammarError, GrammarMasks, GrammarMatchers, GrammarQuery, StepMasks
from cadenza.actors.logit_edits import LogitEdits
from cadenza.actors.rejection_sampler import SpecRow, verify
from cadenza.actors.request import ends_on_token
from cadenza.actors.sampler import SamplingRow, prompt_logprobs, sample, sample_on_device
from cadenza.actors.spec_proposal import ProposalInput, Proposer
from cadenza.actors.stage_link import StageLink
from cadenza.actors.varlen_batch import Chunk, build_batch
from cadenza.kernels.attention.metadata import AttentionMetadata, DecodePlan
from cadenza.messages import HiddenStates, ModelRunnerOutput, NewRequestData, SchedulerOutput, TokenLogprobs
from cadenza.models.llama import LlamaForCausalLM
from cadenza.models.tokenizer import Tokenizer
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


def allocate_kv_cache(
    model: LlamaForCausalLM, num_blocks: int, block_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed, so never-written slots that a padded gather reads are finite (0 * NaN would leak),
    and on the CPU resident only as blocks are first written (see zeroed_kv_tensor)."""
    dtype, device = model.weight_format.cache_dtype(model.norm.dtype), model.norm.device
    caches = []
    for layer in model.layers:  # this pipeline stage's layers, this rank's KV heads
        shape = (num_blocks, block_size, layer.self_attn.num_kv_heads, layer.self_attn.head_dim)
        caches.append((zeroed_kv_tensor(shape, dtype, device), zeroed_kv_tensor(shape, dtype, device)))
    return caches


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU it sits on an anonymous mapping of its own: the kernel hands
    out zero pages and commits each only when it is first written, so a 2 GiB pool costs
    resident memory for the blocks in use, not for all of it. torch.zeros would write (and
    commit) every page up front; torch.empty is lazy only when malloc happens to mmap the
    request, and may otherwise return recycled heap holding NaNs, which the torch reference's
    padded decode would multiply by probability 0 into NaN. A GPU commits memory on
    allocation either way, so there it is plain torch.zeros."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    # The tensor holds a reference to the mapping, which is unmapped with the last tensor.
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype, count=count).view(shape)


class ModelRunner:
    """One worker's runner. With pipeline stages, a stage before the last returns HiddenStates
    for the next; with tensor parallelism every rank computes and only the driver samples.

    samples_ahead (async scheduling, one runner that is the whole model): the scheduler plans
    step N + 1 before it has step N's tokens, so the runner appends its own samples, and stops
    computing a request its own token ended, or whose step failed, until the scheduler drops it.

    grammar_mask_timeout_s: the most a step waits, after its forward pass, for its grammar masks
    (None: as long as they take); a request whose mask is late fails alone.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        is_driver: bool = True,
        proposer: Proposer | None = None,
        tokenizer: Tokenizer | None = None,
        graphs: GraphSettings | None = None,
        link: StageLink | None = None,
        samples_ahead: bool = False,
        grammar_mask_timeout_s: float | None = None,
    ) -> None:
        if samples_ahead and not (is_driver and link is None and proposer is None):
            raise ValueError("a runner samples ahead only as the whole model's one rank, without speculation")
        if link is None and not (model.is_first_stage and model.is_last_stage):
            raise ValueError("a pipeline stage needs a StageLink to its neighbours")
        self.model = model
        self.link = link
        self.block_size = block_size
        self.eos_token_ids = eos_token_ids
        self.is_driver = is_driver
        self.device = model.norm.device
        model.prepare_kernels()
        # With graphs, one block past the pool is the padding rows' scratch (no request owns it).
        self.kv_caches = allocate_kv_cache(model, num_blocks + (graphs is not None), block_size)
        self.graphs = self._capture(graphs, num_blocks) if graphs is not None else None
        self.requests: dict[str, RunnerRequest] = {}
        self.samples_ahead = samples_ahead
        self._stopped: set[str] = set()  # ahead: ended here, awaiting the scheduler's drop
        self._previous: DeviceSamples | None = None  # ahead: the last step's, not yet settled
        self._samples: DeviceSamples | None = None  # ahead: this step's, once sampled
        self.proposer = proposer  # speculative decoding, on the driver only
        # Structured outputs: the driver samples, so it alone follows the grammars.
        self.grammar = (
            GrammarMatchers(tokenizer, eos_token_ids, mask_timeout_s=grammar_mask_timeout_s) if is_driver else None
        )
        self._masks: StepMasks | GrammarMasks = {}
        self._forwarded = 0.0
        self._received: tuple[torch.Tensor, torch.Tensor] | None = None  # this step's, from the stage before

    def execute(
        self, so: SchedulerOutput, previous: HiddenStates | None = None
    ) -> ModelRunnerOutput | HiddenStates | PendingOutput:
        """One step. Scheduling ahead, the output is a PendingOutput: its samples reach the
        host after this returns, and the next step is launched meanwhile (device_samples.py)."""
        started = time.monotonic()
        if previous is not None:  # first, before anything can fail: the sender waits on it
            self._received = self.link.recv(previous, self.device)
        self._update_states(so)
        scheduled = so.num_scheduled_tokens
        if self.samples_ahead:
            scheduled = self._computable(scheduled)
        if not scheduled:
            self._settle()
            return ModelRunnerOutput.empty()
        if self._grammar_waits(scheduled):  # its mask follows the pending token
            self._settle()
        batch = self._prepare(scheduled)
        self._masks = self._start_masks(batch)  # computed while the forward pass runs
        try:
            with torch.inference_mode():
                result = self._forward(batch, previous)
        except Exception:
            self._stopped.update(scheduled if self.samples_ahead else ())  # steps ahead skip them
            raise
        finally:
            self._grammar_masks()  # joined even on failure: a matcher is used by one thread at a time
            self._settle()  # the previous step's samples, whatever became of this one
        if self.proposer is not None and isinstance(result, ModelRunnerOutput):
            result.draft_token_ids = self.proposer.propose(self._proposal_inputs(batch, result, so.num_spec_tokens))
        for rid, n in scheduled.items():
            self.requests[rid].num_computed_tokens += n
        if isinstance(result, ModelRunnerOutput):
            result.timing = [started, self._forwarded, time.monotonic()]
            if self.samples_ahead:
                return self._ahead(result)
        return result

    def _ahead(self, out: ModelRunnerOutput) -> PendingOutput:
        """Ahead, the next step is planned without this step's tokens: the runner keeps them
        itself, those still on the device as pending, fed to the next step from there."""
        self._stopped.update(out.failed)
        for rid, tokens in out.sampled.items():  # sampled on the host (a batch retried alone)
            self._append_own(self.requests[rid], tokens[-1])
        samples, self._samples = self._samples, None
        if samples is not None:
            for rid in samples.req_ids:
                # A request its settled token just ended computed once more; that token is
                # dropped here and by the scheduler, which has ended it.
                self.requests[rid].pending = rid not in self._stopped
            self._previous = samples
        return PendingOutput(out, samples)

    def _append_own(self, req: RunnerRequest, token: int) -> None:
        req.token_ids.append(token)
        if ends_on_token(token, len(req.token_ids) - req.num_prompt_tokens, req.params, self.eos_token_ids):
            self._stopped.add(req.req_id)

    def _settle(self) -> None:
        """The previous step's samples to the host, appended where still pending. Called once
        this step's forward pass is launched, so on a GPU the wait overlaps it."""
        previous, self._previous = self._previous, None
        if previous is None:
            return
        for rid, token in zip(previous.req_ids, previous.values()[0], strict=True):
            req = self.requests.get(rid)
            if req is not None and req.pending:  # not dropped (or its id reused) meanwhile
                req.pending = False
                self._append_own(req, token)

    def _computable(self, scheduled: dict[str, int]) -> dict[str, int]:
        """Ahead: the scheduled requests this runner can compute. Not those it stopped, nor one
        planned past its known tokens: a step planned before it never reached this runner
        (it failed on the way), so the tokens it would have sampled do not exist."""
        for rid, n in scheduled.items():
            req = self.requests[rid]
            if req.num_computed_tokens + n > req.num_known:
                self._stopped.add(rid)
        return {rid: n for rid, n in scheduled.items() if rid not in self._stopped}

    def _grammar_waits(self, scheduled: dict[str, int]) -> bool:
        return any(
            (req := self.requests[rid]).pending and req.params.structured_outputs is not None for rid in scheduled
        )

    def _capture(self, settings: GraphSettings, num_blocks: int) -> DecodeGraphs:
        max_blocks = -(-settings.max_model_len // self.block_size)
        pad_slot = num_blocks * self.block_size  # slot 0 of the scratch block
        graphs = DecodeGraphs(capture_sizes(settings.max_num_seqs), max_blocks, pad_slot, num_blocks, self.device)
        with torch.inference_mode():
            graphs.capture_all(self._decode_step(settings.max_model_len), settings.capture)
        return graphs

    def _decode_step(self, max_model_len: int) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
        """A decode step over static inputs, reading no host value that changes between steps:
        the logits of every row."""
        model = self.model

        def step(x: dict[str, torch.Tensor]) -> torch.Tensor:
            rows = x["input_ids"].shape[0]
            tables, lens = x["block_tables"], x["seq_lens"]
            # Host lists only for shapes: every row one query token, contexts up to max_model_len.
            meta = AttentionMetadata(
                x["slot_mapping"], list(range(rows + 1)), [max_model_len] * rows, lens, tables, rows,
                decode_plan=DecodePlan(None, tables, lens, []),
            )  # fmt: skip
            h, residual = model.run_layers(model.embed(x["input_ids"]), None, x["positions"], self.kv_caches, meta)
            return model.compute_logits(model.final_norm(h, residual))

        return step

    def _replay(self, batch: Batch) -> torch.Tensor | None:
        """The logits of a step from a graph when every token it computes is sampled: decodes,
        and speculative verification (a request's k + 1 tokens are k + 1 one-query rows, each
        seeing the keys up to its own position). None: run it eagerly (a prompt chunk, or no
        graph holds that many rows)."""
        num_tokens = batch.input_ids.shape[0]
        if self.graphs is None or len(batch.sample_rows) != num_tokens:
            return None
        meta = batch.meta
        tables = meta.block_tables
        if num_tokens != meta.num_reqs:  # verification: each token's row takes its request's table
            qsl = meta.query_start_loc
            per_request = to_device([qsl[i + 1] - qsl[i] for i in range(meta.num_reqs)], torch.long, tables.device)
            tables = tables.repeat_interleave(per_request, dim=0)
        inputs = {
            "input_ids": batch.input_ids,
            "positions": batch.positions,
            "slot_mapping": meta.slot_mapping,
            "seq_lens": batch.positions + 1,  # causal: the keys up to and including its own
            "block_tables": tables,
        }
        return self.graphs.run(inputs)

    def _forward(self, batch: Batch, previous: HiddenStates | None) -> ModelRunnerOutput | HiddenStates:
        logits = self._replay(batch)
        if logits is not None:  # every row samples, so none is a prompt position
            self._forwarded = time.monotonic()
            return self._sample(logits, batch)
        model = self.model
        if model.is_first_stage:
            x, residual = model.embed(batch.input_ids), None
        elif previous is None:
            raise ValueError("a later pipeline stage needs the previous stage's hidden states")
        else:
            x, residual = self._received
        x, residual = model.run_layers(x, residual, batch.positions, self.kv_caches, batch.meta)
        if not model.is_last_stage:
            return self.link.send(x, residual)
        hidden = model.final_norm(x, residual)
        self._forwarded = time.monotonic()  # the timeline's forward / sample boundary
        # Sampled where the logits are: only the token ids (and logprobs asked for) reach the host.
        logits = self.model.compute_logits(take_rows(hidden, batch.sample_rows)) if batch.sampling else None
        out = self._sample(logits, batch)
        out.prompt_logprobs = self._prompt_logprobs(hidden, batch, out.failed)
        return out

    def _start_masks(self, batch: Batch) -> StepMasks | GrammarMasks:
        if self.grammar is None:
            return {}
        # Only requests with a grammar: the others pay nothing (not even the output slice).
        queries = [
            GrammarQuery(r.req_id, r.params, r.output_ids, r.spec_token_ids)
            for r in batch.sampling
            if r.params.structured_outputs is not None
        ]
        return self.grammar.start(queries)

    def _grammar_masks(self) -> GrammarMasks:
        """Joined once a step, within the grammar_mask_timeout_s: a mask not ready by then fails
        its own request (GrammarError), never the step."""
        if isinstance(self._masks, StepMasks):
            self._masks = self.grammar.join(self._masks)  # type: ignore[union-attr]
        return self._masks

    def _drop(self, rid: str) -> None:
        if self.proposer is not None:
            self.proposer.drop(rid)
        if self.grammar is not None:
            self.grammar.drop(rid)

    def _update_states(self, so: SchedulerOutput) -> None:
        if any(delta.new_token_ids for delta in so.cached_requests):  # they follow any pending one
            self._settle()
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
            self._stopped.discard(rid)
            self._drop(rid)
        for new in so.new_requests:
            self.requests[new.req_id] = RunnerRequest.from_new(new)
            if self.proposer is not None:
                self.proposer.start(new.req_id, new.num_computed_tokens)
        for delta in so.cached_requests:
            if delta.req_id in self._stopped:
                continue
            state = self.requests[delta.req_id]
            state.block_ids.extend(delta.new_block_ids)
            state.token_ids.extend(delta.new_token_ids)
            state.num_computed_tokens = delta.num_computed_tokens
        for rid in so.num_scheduled_tokens.keys() - self._stopped:
            self.requests[rid].spec_token_ids = so.scheduled_spec_tokens.get(rid, [])

    def _prepare(self, scheduled: dict[str, int]) -> Batch:
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
        if fed_rows:
            fed_ids(ids, fed_rows, self._previous, fed_reqs)
        return Batch(ids, positions, meta, reqs, [c.end for c in chunks], sample_rows, sampling)

    def _sample(self, logits: torch.Tensor | None, batch: Batch) -> ModelRunnerOutput:
        """logits: one row per sample row of the batch (None when nothing samples)."""
        if logits is None:
            return ModelRunnerOutput.empty()
        if not self.is_driver:  # the gather above is collective; sampling is the driver's alone
            return ModelRunnerOutput.empty()
        self._settle()  # penalties, seeds and min_tokens read the outputs so far
        out = ModelRunnerOutput.empty()
        masks = self._grammar_masks()
        plain, plain_rows, spec, spec_rows = [], [], [], []
        row = 0
        for req in batch.sampling:
            n = len(req.spec_token_ids) + 1
            error = masks.get(req.req_id)
            if isinstance(error, GrammarError):  # this request's grammar failed: it alone ends
                out.failed[req.req_id] = f"structured output failed: {error}"
            elif req.spec_token_ids:
                spec.append(req)
                spec_rows += range(row, row + n)
            else:
                plain.append(req)
                plain_rows.append(row)
            row += n
        if plain:
            self._sample_plain(out, logits, plain, plain_rows)
        if spec:
            self._verify(out, logits, spec, spec_rows)
        return out

    # A request's own settings can still break sampling (a value no check foresaw): the batch
    # is then sampled again one request at a time, and only the request that fails alone is
    # reported in `failed`. The forward pass is never repeated.

    def _sample_plain(
        self, out: ModelRunnerOutput, logits: torch.Tensor, reqs: list, rows: list[int], on_device: bool | None = None
    ) -> None:
        """Ahead, the batch's samples stay on the device (self._samples); a batch retried one
        request at a time samples on the host."""
        on_device = self.samples_ahead if on_device is None else on_device
        try:
            sampling_rows = [self._row(r, mask=self._mask(r, 0)) for r in reqs]
            if on_device:
                tokens, logprobs = sample_on_device(take_rows(logits, rows), sampling_rows)
                self._samples = DeviceSamples([r.req_id for r in reqs], tokens, logprobs)
                return
            tokens, logprobs = sample(logits[rows], sampling_rows)
        except Exception as e:
            retry = lambda r, row: self._sample_plain(out, logits, [r], [row], on_device=False)  # noqa: E731
            self._one_by_one(out, e, reqs, rows, retry)
            return
        self._record(out, reqs, [[t] for t in tokens], [None if lp is None else [lp] for lp in logprobs])

    def _verify(self, out: ModelRunnerOutput, logits: torch.Tensor, reqs: list, rows: list[int]) -> None:
        try:
            spec_rows = [
                SpecRow(self._row(r), r.spec_token_ids, self._draft_probs(r.req_id), self._masks_of(r)) for r in reqs
            ]
            result = verify(logits[rows], spec_rows)
        except Exception as e:
            per_req, at = [], 0
            for r in reqs:
                per_req.append(rows[at : at + len(r.spec_token_ids) + 1])
                at += len(r.spec_token_ids) + 1
            self._one_by_one(out, e, reqs, per_req, lambda r, rr: self._verify(out, logits, [r], rr))
            return
        self._record(out, reqs, *result)

    @staticmethod
    def _one_by_one(out: ModelRunnerOutput, error: Exception, reqs: list, rows: list, retry: Callable) -> None:
        if len(reqs) == 1:
            out.failed[reqs[0].req_id] = f"sampling failed: {type(error).__name__}: {error}"
            return
        for req, row in zip(reqs, rows, strict=True):
            retry(req, row)

    def _draft_probs(self, req_id: str) -> torch.Tensor | None:
        return self.proposer.draft_probs(req_id) if self.proposer is not None else None

    def _masks_of(self, req: RunnerRequest) -> list[torch.Tensor] | None:
        masks = self._grammar_masks().get(req.req_id)
        return masks if isinstance(masks, list) else None

    def _mask(self, req: RunnerRequest, position: int) -> torch.Tensor | None:
        masks = self._masks_of(req)
        return masks[position] if masks is not None else None

    def _row(
        self, req: RunnerRequest, new_tokens: list[int] | None = None, mask: torch.Tensor | None = None
    ) -> SamplingRow:
        outputs = req.output_ids + (new_tokens or [])
        prompt = req.token_ids[: req.num_prompt_tokens]
        return SamplingRow(req.params, prompt, outputs, self._stop_ids(req.params), mask, req.edits)

    @staticmethod
    def _record(
        out: ModelRunnerOutput,
        reqs: list[RunnerRequest],
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprobs] | None],
    ) -> None:
        for req, toks, lps in zip(reqs, tokens, logprobs, strict=True):
            out.sampled[req.req_id] = toks
            if lps is not None:
                out.logprobs[req.req_id] = lps

    def _proposal_inputs(self, batch: Batch, out: ModelRunnerOutput, num_spec: dict[str, int]) -> list[ProposalInput]:
        """Every request of the step (a draft model keeps its KV in step with all of them)."""
        inputs = []
        for req, end in zip(batch.reqs, batch.ends, strict=True):
            new = out.sampled.get(req.req_id, [])
            known = req.token_ids + new
            valid = len(known) - 1 if new else end
            k = num_spec.get(req.req_id, 0) if new else 0
            inputs.append(ProposalInput(req.req_id, known, req.block_ids, valid, k, self._row(req, new)))
        return inputs

    def _stop_ids(self, params: SamplingParams) -> tuple[int, ...]:
        eos = () if params.ignore_eos else self.eos_token_ids
        return (*eos, *params.stop_token_ids)

    def _prompt_logprobs(
        self, hidden: torch.Tensor, batch: Batch, failed: dict[str, str]
    ) -> dict[str, list[TokenLogprobs]]:
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
            try:
                result[req.req_id] = prompt_logprobs(logits, req.token_ids[start + 1 : stop + 1], k)
            except Exception as e:  # this request's own setting; the rest of the batch goes on
                failed[req.req_id] = f"prompt logprobs failed: {type(e).__name__}: {e}"
        return result
