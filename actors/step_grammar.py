"""A step's grammar masks: started from the batch before the forward pass, so the grammar
thread computes them while it runs, and joined once after it, within grammar_mask_timeout_s.
A mask not ready by then fails its own request (GrammarError), never the step."""

from __future__ import annotations

import torch

from cadenza.actors.grammar_matchers import GrammarMasks, GrammarMatchers, GrammarQuery, StepMasks
from cadenza.actors.input_batch import RunnerRequest


class StepGrammar:
    """The driver's matchers (None on a rank that does not sample) and this step's masks."""

    def __init__(self, matchers: GrammarMatchers | None) -> None:
        self.matchers = matchers
        self._masks: StepMasks | GrammarMasks = {}

    def start(self, sampling: list[RunnerRequest]) -> None:
        if self.matchers is None:
            self._masks = {}
            return
        # Only requests with a grammar: the others pay nothing (not even the output slice).
        queries = [
            GrammarQuery(r.req_id, r.params, r.output_ids, r.spec_token_ids)
            for r in sampling
            if r.params.structured_outputs is not None
        ]
        self._masks = self.matchers.start(queries)

    def join(self) -> GrammarMasks:
        """Idempotent: joined even when the forward pass fails, since a matcher is used by one
        thread at a time, and read again by sampling."""
        if isinstance(self._masks, StepMasks):
            self._masks = self.matchers.join(self._masks)  # type: ignore[union-attr]
        return self._masks


def masks_of(masks: GrammarMasks, req: RunnerRequest) -> list[torch.Tensor] | None:
    """The request's masks, one per sampled position, or None (no grammar, or it failed)."""
    found = masks.get(req.req_id)
    return found if isinstance(found, list) else None


def mask_at(masks: GrammarMasks, req: RunnerRequest, position: int) -> torch.Tensor | None:
    found = masks_of(masks, req)
    return found[position] if found is not None else None
