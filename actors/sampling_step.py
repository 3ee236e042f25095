"""What a step samples from its logits: the next token of each request that caught up with its
known tokens (plain), or the verdict on its drafts (speculative, by rejection sampling), each
under its grammar mask; and the prompt logprobs asked for at prompt positions.

A request's own settings can still break sampling (a value no check foresaw): the batch is
then sampled again one request at a time, and only the request that fails alone is reported
in `failed`. The forward pass is never repeated."""

from __future__ import annotations

from collections.abc import Callable

import torch

from cadenza.actors.device_copy import take_rows
from cadenza.actors.device_samples import DeviceSamples
from cadenza.actors.grammar_matchers import GrammarError, GrammarMasks
from cadenza.actors.input_batch import Batch, RunnerRequest
from cadenza.actors.rejection_sampler import SpecRow, verify
from cadenza.actors.sampler import SamplingRow, prompt_logprobs, sample_on_device
from cadenza.actors.spec_proposal import Proposer
from cadenza.actors.step_grammar import mask_at, masks_of
from cadenza.messages import ModelRunnerOutput, TokenLogprobs
from cadenza.models.llama import LlamaForCausalLM

HostSample = Callable[[torch.Tensor, list[SamplingRow]], tuple[list[int], list[TokenLogprobs | None]]]
Retry = Callable[[RunnerRequest, list[int]], None]


class SamplingStep:
    """One step's sampling. logits: one row per sample row of the batch's sampling requests
    (k + 1 for a request verifying k drafts); masks: the step's joined grammar masks."""

    def __init__(
        self,
        logits: torch.Tensor,
        masks: GrammarMasks,
        eos_token_ids: tuple[int, ...],
        proposer: Proposer | None,
        host_sample: HostSample,
    ) -> None:
        self.logits = logits
        self.masks = masks
        self.eos_token_ids = eos_token_ids
        self.proposer = proposer
        self.host_sample = host_sample
        self.out = ModelRunnerOutput.empty()

    def run(self, sampling: list[RunnerRequest], on_device: bool) -> tuple[ModelRunnerOutput, DeviceSamples | None]:
        """on_device (scheduling ahead): the plain samples stay on the device, returned apart;
        a batch retried one request at a time samples on the host, into the output."""
        plain, plain_rows, spec, spec_rows = self._split(sampling)
        samples = self._plain(plain, plain_rows, on_device) if plain else None
        if spec:
            self._verify(spec, spec_rows)
        return self.out, samples

    def _split(self, sampling: list[RunnerRequest]) -> tuple[list, list[int], list, list[int]]:
        """(plain requests, their rows, speculative requests, their rows); a request whose
        grammar failed is failed here, alone."""
        plain, plain_rows, spec, spec_rows = [], [], [], []
        row = 0
        for req in sampling:
            n = len(req.spec_token_ids) + 1
            error = self.masks.get(req.req_id)
            if isinstance(error, GrammarError):
                self.out.failed[req.req_id] = f"structured output failed: {error}"
            elif req.spec_token_ids:
                spec.append(req)
                spec_rows += range(row, row + n)
            else:
                plain.append(req)
                plain_rows.append(row)
            row += n
        return plain, plain_rows, spec, spec_rows

    def _plain(self, reqs: list[RunnerRequest], rows: list[int], on_device: bool) -> DeviceSamples | None:
        try:
            sampling_rows = [r.sampling_row(self.eos_token_ids, mask=mask_at(self.masks, r, 0)) for r in reqs]
            if on_device:
                tokens, logprobs = sample_on_device(take_rows(self.logits, rows), sampling_rows)
                return DeviceSamples([r.req_id for r in reqs], tokens, logprobs)
            tokens, logprobs = self.host_sample(self.logits[rows], sampling_rows)
        except Exception as e:
            self._one_by_one(e, reqs, [[row] for row in rows], lambda r, row: self._plain([r], row, on_device=False))
            return None
        self._record(reqs, [[t] for t in tokens], [None if lp is None else [lp] for lp in logprobs])
        return None

    def _verify(self, reqs: list[RunnerRequest], rows: list[int]) -> None:
        try:
            result = verify(self.logits[rows], [self._spec_row(r) for r in reqs])
        except Exception as e:
            per_req, at = [], 0
            for r in reqs:
                per_req.append(rows[at : at + len(r.spec_token_ids) + 1])
                at += len(r.spec_token_ids) + 1
            self._one_by_one(e, reqs, per_req, lambda r, rr: self._verify([r], rr))
            return
        self._record(reqs, *result)

    def _one_by_one(self, error: Exception, reqs: list[RunnerRequest], rows: list[list[int]], retry: Retry) -> None:
        if len(reqs) == 1:
            self.out.failed[reqs[0].req_id] = f"sampling failed: {type(error).__name__}: {error}"
            return
        for req, req_rows in zip(reqs, rows, strict=True):
            retry(req, req_rows)

    def _spec_row(self, req: RunnerRequest) -> SpecRow:
        draft_probs = self.proposer.draft_probs(req.req_id) if self.proposer is not None else None
        return SpecRow(req.sampling_row(self.eos_token_ids), req.spec_token_ids, draft_probs, masks_of(self.masks, req))

    def _record(
        self, reqs: list[RunnerRequest], tokens: list[list[int]], logprobs: list[list[TokenLogprobs] | None]
    ) -> None:
        for req, toks, lps in zip(reqs, tokens, logprobs, strict=True):
            self.out.sampled[req.req_id] = toks
            if lps is not None:
                self.out.logprobs[req.req_id] = lps


def batch_prompt_logprobs(
    model: LlamaForCausalLM, hidden: torch.Tensor, batch: Batch, failed: dict[str, str]
) -> dict[str, list[TokenLogprobs]]:
    """Rows at prompt positions p < num_prompt - 1 predict prompt token p + 1. A request whose
    own setting breaks them is put in `failed`; the rest of the batch goes on."""
    result: dict[str, list[TokenLogprobs]] = {}
    # Every TP rank takes the same branches: compute_logits is a collective.
    qsl = batch.meta.query_start_loc
    for i, req in enumerate(batch.reqs):
        k = req.params.prompt_logprobs
        start = req.num_computed_tokens
        stop = min(start + qsl[i + 1] - qsl[i], req.num_prompt_tokens - 1)
        if k is None or start >= stop:
            continue
        logits = model.compute_logits(hidden[qsl[i] : qsl[i] + stop - start]).cpu()
        try:
            result[req.req_id] = prompt_logprobs(logits, req.token_ids[start + 1 : stop + 1], k)
        except Exception as e:
            failed[req.req_id] = f"prompt logprobs failed: {type(e).__name__}: {e}"
    return result
