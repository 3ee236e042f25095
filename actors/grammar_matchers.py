"""GrammarMatchers: the sampling driver's grammar state per request, and its token masks.

A matcher follows a request's output tokens as the scheduler reports them (catching up
after preemption or a rejected draft by rolling back), so it holds no state the runner
could lose. Masks for a step are computed in a thread while the forward pass runs
(llguidance drops the GIL), and joined just before sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from cadenza.sampling_params import SamplingParams
from cadenza.structured_outputs import StructuredOutputs

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer

    from cadenza.models.tokenizer import Tokenizer

_BITS = torch.arange(32, dtype=torch.int32)


@dataclass(slots=True)
class GrammarQuery:
    """One request's question for a step: its outputs so far and the drafts being verified."""

    req_id: str
    params: SamplingParams
    output_ids: list[int]
    draft_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    matcher: LLMatcher
    consumed: list[int] = field(default_factory=list)  # the output tokens the matcher has taken


class GrammarError(ValueError):
    """The request's own grammar failed (its output left it, or it could not be built)."""


class GrammarMatchers:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: tuple[int, ...], overlap: bool = True) -> None:
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._tracked: dict[str, _Tracked] = {}
        # One thread: masks of one step are a few 0.1 ms; a pool would only add contention.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar") if overlap else None

    @property
    def overlap(self) -> bool:
        """Masks computed in a thread during the forward pass (else inline, before sampling)."""
        return self._pool is not None

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if on and self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        elif not on and self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @cached_property
    def lltokenizer(self) -> LLTokenizer:
        """Built on first use (~0.3 s for a 49k vocabulary), not at load: most engines never
        see a grammar."""
        from llguidance import LLTokenizer

        if self._tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer, and this model has none")
        backend = self._tokenizer.backend
        return LLTokenizer(backend.to_str(), n_vocab=backend.get_vocab_size(), eos_token=list(self._eos))

    def start(self, queries: Sequence[GrammarQuery]) -> Future | dict:
        """Begin this step's masks (queries of requests with a grammar): a future (overlap on)
        or the masks themselves."""
        if self._pool is None or not queries:
            return self.masks(queries)
        return self._pool.submit(self.masks, queries)

    def masks(self, queries: Sequence[GrammarQuery]) -> dict[str, list[torch.Tensor] | GrammarError]:
        """Per request, the mask at each of its 1 + len(drafts) positions, or its error."""
        result: dict[str, list[torch.Tensor] | GrammarError] = {}
        for q in queries:
            try:
                result[q.req_id] = self._masks_for(q)
            except GrammarError as e:
                result[q.req_id] = e
        return result

    def drop(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)

    def _masks_for(self, q: GrammarQuery) -> list[torch.Tensor]:
        tracked = self._sync(q)
        matcher = tracked.matcher
        masks = [self._mask(matcher)]
        taken = 0
        for token in q.draft_ids:  # the mask after each draft, as if it were accepted
            allowed = masks[-1]
            if token >= allowed.shape[0] or not bool(allowed[token]):
                break  # refused here, so rejected here: later positions are never sampled
            if token in self._eos:
                break  # accepted, it ends the request; a stopped matcher would not count it
            matcher.consume_token(token)
            taken += 1
            masks.append(self._mask(matcher))
        masks += [masks[-1]] * (len(q.draft_ids) + 1 - len(masks))
        if taken:
            matcher.rollback(taken)
        return masks

    def _sync(self, q: GrammarQuery) -> _Tracked:
        """The matcher after exactly q.output_ids: extended by new tokens, rolled back where
        the history diverged (a preempted request resumes with the same outputs, so this is
        rare), rebuilt when rollback cannot reach."""
        tracked = self._tracked.get(q.req_id) or self._new(q)
        common = _common_prefix(tracked.consumed, q.output_ids)
        if common < len(tracked.consumed) and not tracked.matcher.rollback(len(tracked.consumed) - common):
            tracked = self._new(q)
            common = 0
        del tracked.consumed[common:]
        for token in q.output_ids[common:]:
            if not tracked.matcher.consume_token(token):
                raise GrammarError(f"the output left the grammar at token {token}: {tracked.matcher.get_error()}")
            tracked.consumed.append(token)
        return tracked

    def _new(self, q: GrammarQuery) -> _Tracked:
        from llguidance import LLMatcher

        spec: StructuredOutputs = q.params.structured_outputs  # type: ignore[assignment]
        matcher = LLMatcher(self.lltokenizer, spec.llguidance_grammar(), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"{spec.source}: {matcher.get_error()}")
        self._tracked[q.req_id] = tracked = _Tracked(matcher)
        return tracked

    @staticmethod
    def _mask(matcher: LLMatcher) -> torch.Tensor:
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        return ((words[:, None] >> _BITS) & 1).bool().flatten()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
