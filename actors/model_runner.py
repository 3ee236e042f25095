"""ModelRunner: owns the model and its KV cache, and runs one SchedulerOutput as one forward
pass over a flattened (varlen) batch, then samples. It orchestrates parts that each hold one
job: input_batch (request state, batch building), graph_runner (decode CUDA graphs),
stage_link (pipeline send and receive), step_grammar (the step's grammar masks),
sampling_step (plain, speculative and grammar-masked sampling, prompt logprobs),
samples_ahead (async scheduling's own samples) and kv_tensors (the pool's tensors)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from cadenza.actors.cuda_graphs import GraphSettings
from cadenza.actors.device_copy import take_rows
from cadenza.actors.device_samples import DeviceSamples, PendingOutput, fed_ids
from cadenza.actors.grammar_matchers import GrammarMatchers
from cadenza.actors.graph_runner import capture_decode_graphs, replay
from cadenza.actors.input_batch import PLACEHOLDER_ID as PLACEHOLDER_ID  # re-exported: tests name it here
from cadenza.actors.input_batch import Batch, InputBatch, RunnerRequest
from cadenza.actors.kv_tensors import allocate_kv_cache
from cadenza.actors.kv_tensors import zeroed_kv_tensor as zeroed_kv_tensor  # re-exported: tests name it here
from cadenza.actors.sampler import sample
from cadenza.actors.samples_ahead import SamplesAhead
from cadenza.actors.sampling_step import SamplingStep, batch_prompt_logprobs
from cadenza.actors.spec_proposal import Proposer
from cadenza.actors.stage_link import StageLink
from cadenza.actors.step_grammar import StepGrammar
from cadenza.messages import HiddenStates, ModelRunnerOutput, SchedulerOutput
from cadenza.models.llama import LlamaForCausalLM
from cadenza.models.tokenizer import Tokenizer


class ModelRunner:
    """One worker's runner. With pipeline stages, a stage before the last returns HiddenStates
    for the next; with tensor parallelism every rank computes and only the driver samples.

    samples_ahead (async scheduling, one runner that is the whole model): the scheduler plans
    step N + 1 before it has step N's tokens, so the runner appends its own samples, and stops
    computing a request its own token ended, or whose step failed, until the scheduler drops it.

    grammar_mask_timeout_s: the most a step waits, after its forward pass, for its grammar masks
    (None: as long as they take); a request whose mask is late fails alone.
    kv_share_place: where this process is (runner_setup.kv_place), to allocate the KV cache so
    that other engines there can read it (the `ipc` KV transport); None: private.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        is_driver: bool = True,
        proposer: Proposer | None = None,
        load_tokenizer: Callable[[], Tokenizer | None] = lambda: None,  # for grammars, called on the first
        graphs: GraphSettings | None = None,
        link: StageLink | None = None,
        samples_ahead: bool = False,
        grammar_mask_timeout_s: float | None = None,
        kv_share_place: str | None = None,
    ) -> None:
        if samples_ahead and not (is_driver and link is None and proposer is None):
            raise ValueError("a runner samples ahead only as the whole model's one rank, without speculation")
        if link is None and not (model.is_first_stage and model.is_last_stage):
            raise ValueError("a pipeline stage needs a StageLink to its neighbours")
        self.model, self.link, self.block_size = model, link, block_size
        self.eos_token_ids, self.is_driver, self.device = eos_token_ids, is_driver, model.norm.device
        model.prepare_kernels()
        # With graphs, one block past the pool is the padding rows' scratch (no request owns it).
        self.kv_caches = allocate_kv_cache(model, num_blocks + (graphs is not None), block_size, kv_share_place)
        self.graphs = (
            capture_decode_graphs(model, self.kv_caches, graphs, num_blocks, block_size) if graphs is not None else None
        )
        self.inputs = InputBatch(block_size, self.device)
        self.samples_ahead = samples_ahead
        self.ahead = SamplesAhead(self.inputs.requests, eos_token_ids)
        self.proposer = proposer  # speculative decoding, on the driver only
        # Structured outputs: the driver samples, so it alone follows the grammars.
        self.grammar = (
            GrammarMatchers(load_tokenizer, eos_token_ids, mask_timeout_s=grammar_mask_timeout_s) if is_driver else None
        )
        self.step_grammar = StepGrammar(self.grammar)
        self._forwarded = 0.0  # the step's forward / sample boundary, for its timing

    @property
    def requests(self) -> dict[str, RunnerRequest]:
        return self.inputs.requests

    @property
    def _previous(self) -> DeviceSamples | None:
        """Scheduling ahead: the last step's samples, not yet settled."""
        return self.ahead.previous

    def execute(
        self, so: SchedulerOutput, previous: HiddenStates | None = None
    ) -> ModelRunnerOutput | HiddenStates | PendingOutput:
        """One step. Scheduling ahead, the output is a PendingOutput: its samples reach the
        host after this returns, and the next step is launched meanwhile (device_samples.py)."""
        started = time.monotonic()
        # First, before anything can fail: the previous stage's sender waits on it.
        received = self.link.recv(previous, self.device) if previous is not None else None
        self._update_states(so)
        scheduled = self.ahead.computable(so.num_scheduled_tokens) if self.samples_ahead else so.num_scheduled_tokens
        if not scheduled:
            self._settle()
            return ModelRunnerOutput.empty()
        if self.ahead.grammar_waits(scheduled):  # its mask follows the pending token
            self._settle()
        batch = self._prepare(scheduled)
        self.step_grammar.start(batch.sampling)  # computed while the forward pass runs
        try:
            with torch.inference_mode():
                result = self._forward(batch, received)
        except Exception:
            self.ahead.stopped.update(scheduled if self.samples_ahead else ())  # steps ahead skip them
            raise
        finally:
            self.step_grammar.join()  # even on failure: a matcher is used by one thread at a time
            self._settle()  # the previous step's samples, whatever became of this one
        if self.proposer is not None and isinstance(result, ModelRunnerOutput):
            inputs = batch.proposal_inputs(result, so.num_spec_tokens, self.eos_token_ids)
            result.draft_token_ids = self.proposer.propose(inputs)
        self.inputs.advance(scheduled)
        if not isinstance(result, ModelRunnerOutput):
            return result
        result.timing = [started, self._forwarded, time.monotonic()]
        return self.ahead.finish(result) if self.samples_ahead else result

    def _settle(self) -> None:
        """Called once this step's forward pass is launched, so on a GPU the wait overlaps it."""
        self.ahead.settle()

    def _update_states(self, so: SchedulerOutput) -> None:
        if any(delta.new_token_ids for delta in so.cached_requests):  # they follow any pending one
            self._settle()
        for rid in so.finished_req_ids:
            self.ahead.stopped.discard(rid)
            self._drop(rid)
        self.inputs.update(so, self.ahead.stopped)
        for new in so.new_requests:
            if self.proposer is not None:
                self.proposer.start(new.req_id, new.num_computed_tokens)

    def _drop(self, rid: str) -> None:
        if self.proposer is not None:
            self.proposer.drop(rid)
        if self.grammar is not None:
            self.grammar.drop(rid)

    def _prepare(self, scheduled: dict[str, int]) -> Batch:
        batch = self.inputs.build(scheduled)
        if batch.fed_rows:  # pending tokens are written from where they were sampled
            fed_ids(batch.input_ids, batch.fed_rows, self.ahead.previous, batch.fed_reqs)
        return batch

    def _replay(self, batch: Batch) -> torch.Tensor | None:
        return replay(self.graphs, batch) if self.graphs is not None else None

    def _forward(
        self, batch: Batch, received: tuple[torch.Tensor, torch.Tensor] | None
    ) -> ModelRunnerOutput | HiddenStates:
        logits = self._replay(batch)
        if logits is not None:  # every row samples, so none is a prompt position
            self._forwarded = time.monotonic()
            return self._sample(logits, batch)
        model = self.model
        x, residual = self._layers_input(batch, received)
        x, residual = model.run_layers(x, residual, batch.positions, self.kv_caches, batch.meta)
        if not model.is_last_stage:
            return self.link.send(x, residual)
        hidden = model.final_norm(x, residual)
        self._forwarded = time.monotonic()  # the timeline's forward / sample boundary
        # Sampled where the logits are: only the token ids (and logprobs asked for) reach the host.
        logits = model.compute_logits(take_rows(hidden, batch.sample_rows)) if batch.sampling else None
        out = self._sample(logits, batch)
        out.prompt_logprobs = batch_prompt_logprobs(model, hidden, batch, out.failed)
        return out

    def _layers_input(
        self, batch: Batch, received: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual): the first stage embeds the ids, a later one takes the previous stage's."""
        if self.model.is_first_stage:
            return self.model.embed(batch.input_ids), None
        if received is None:
            raise ValueError("a later pipeline stage needs the previous stage's hidden states")
        return received

    def _sample(self, logits: torch.Tensor | None, batch: Batch) -> ModelRunnerOutput:
        """logits: one row per sample row of the batch (None when nothing samples)."""
        if logits is None or not self.is_driver:  # the gather above is collective; sampling is the driver's
            return ModelRunnerOutput.empty()
        self._settle()  # penalties, seeds and min_tokens read the outputs so far
        # `sample` is read from this module each step, so a test can swap in one that breaks.
        step = SamplingStep(logits, self.step_grammar.join(), self.eos_token_ids, self.proposer, sample)
        out, self.ahead.samples = step.run(batch.sampling, on_device=self.samples_ahead)
        return out
