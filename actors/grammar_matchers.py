"""GrammarMatchers: the sampling driver's grammar state per request, and its token masks.

A matcher follows a request's output tokens as the scheduler reports them (catching up
after preemption or a rejected draft by rolling back), so it holds no state the runner
could lose. Masks for a step are computed in a thread while the forward pass runs
(llguidance drops the GIL), and joined just before sampling.

Each distinct grammar (StructuredOutputs.digest) is compiled once into a template matcher
that every request with that grammar copies (all n children of one request share it): a
copy costs ~0.1 ms, a compile grows with the grammar (0.25 s for a 325 KB schema on the
2-core host). The join is time-boxed (mask_timeout_s): a request whose mask is still being
computed then fails alone, the requests the thread had not reached yet get theirs inline,
and later steps get a fresh thread (the old one ends after that slow mask).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
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
# Distinct grammars kept compiled; a request's own copy lives as long as the request.
TEMPLATE_CACHE_SIZE = 64


@dataclass(slots=True)
class GrammarQuery:
    """One request's question for a step: its outputs so far and the drafts being verified."""

    req_id: str
    params: SamplingParams
    output_ids: list[int]
    draft_ids: list[int] = field(default_factory=list)

    @property
    def spec(self) -> StructuredOutputs:
        return self.params.structured_outputs  # type: ignore[return-value]


@dataclass(slots=True)
class _Tracked:
    matcher: LLMatcher
    consumed: list[int] = field(default_factory=list)  # the output tokens the matcher has taken


class GrammarError(ValueError):
    """The request's own grammar failed (its output left it, it could not be built, or its
    mask was not ready in time)."""


GrammarMasks = dict[str, list[torch.Tensor] | GrammarError]


class StepMasks:
    """One step's masks, filled request by request by the grammar thread until the join seals
    it; after the seal the thread claims no request and writes no result."""

    def __init__(self, queries: Sequence[GrammarQuery]) -> None:
        self.queries = list(queries)
        self.results: GrammarMasks = {}
        self.done = threading.Event()
        self._current: GrammarQuery | None = None
        self._sealed = False
        self._lock = threading.Lock()

    def claim(self, q: GrammarQuery) -> bool:
        with self._lock:
            self._current = None if self._sealed else q
            return not self._sealed

    def put(self, q: GrammarQuery, result: list[torch.Tensor] | GrammarError) -> bool:
        """False when the step was sealed while q was computed: q's request has failed."""
        with self._lock:
            self._current = None
            if not self._sealed:
                self.results[q.req_id] = result
            return not self._sealed

    def seal(self) -> GrammarQuery | None:
        """Stop the thread; the query it is computing now (None if it is between two)."""
        with self._lock:
            self._sealed = True
            return self._current


class GrammarMatchers:
    def __init__(
        self,
        load_tokenizer: Callable[[], Tokenizer | None],
        eos_token_ids: tuple[int, ...],
        overlap: bool = True,
        mask_timeout_s: float | None = None,
    ) -> None:
        self._load_tokenizer = load_tokenizer  # called on the first grammar (LoadedModel.tokenizer)
        self._eos = eos_token_ids
        self.mask_timeout_s = mask_timeout_s  # None: the join waits as long as the masks take
        self._tracked: dict[str, _Tracked] = {}
        self._templates: OrderedDict[str, LLMatcher] = OrderedDict()
        self._templates_lock = threading.Lock()  # an abandoned thread may still add one
        # One thread: masks of one step are a few 0.1 ms; a pool would only add contention.
        self._pool = self._new_pool() if overlap else None

    @staticmethod
    def _new_pool() -> ThreadPoolExecutor:
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

    @property
    def overlap(self) -> bool:
        """Masks computed in a thread during the forward pass (else inline, before sampling)."""
        return self._pool is not None

    @overlap.setter
    def overlap(self, on: bool) -> None:
        if on and self._pool is None:
            self._pool = self._new_pool()
        elif not on and self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    @cached_property
    def lltokenizer(self) -> LLTokenizer:
        """Built on first use (~0.3 s for a 49k vocabulary), not at load: most engines never
        see a grammar."""
        from llguidance import LLTokenizer

        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer, and this model has none")
        backend = tokenizer.backend
        return LLTokenizer(backend.to_str(), n_vocab=backend.get_vocab_size(), eos_token=list(self._eos))

    def start(self, queries: Sequence[GrammarQuery]) -> StepMasks | GrammarMasks:
        """Begin this step's masks (queries of requests with a grammar): a StepMasks for
        join() (overlap on) or the masks themselves."""
        if self._pool is None or not queries:
            return self.masks(queries)
        step = StepMasks(queries)
        self._pool.submit(self._fill, step)
        return step

    def join(self, pending: StepMasks | GrammarMasks) -> GrammarMasks:
        """The step's masks, waiting at most mask_timeout_s for the thread."""
        if isinstance(pending, dict):
            return pending
        if pending.done.wait(self.mask_timeout_s):
            return pending.results
        stuck = pending.seal()
        results = dict(pending.results)
        if stuck is not None:  # the thread ends after this mask; later steps need another
            self._pool.shutdown(wait=False, cancel_futures=True)  # type: ignore[union-attr]
            self._pool = self._new_pool()
            self._tracked.pop(stuck.req_id, None)
            results[stuck.req_id] = self._late(stuck)
        for q in pending.queries:
            if q.req_id not in results:  # never reached by the thread: nothing else touches it
                shares = stuck is not None and self._compiling(q, stuck)
                results[q.req_id] = self._late(q) if shares else self.masks([q])[q.req_id]
        return results

    def masks(self, queries: Sequence[GrammarQuery]) -> GrammarMasks:
        """Per request, the mask at each of its 1 + len(drafts) positions, or its error."""
        return {q.req_id: self._masks_or_error(q) for q in queries}

    def drop(self, req_id: str) -> None:
        self._tracked.pop(req_id, None)

    def _fill(self, step: StepMasks) -> None:
        try:
            for q in step.queries:
                if not step.claim(q):
                    return
                if not step.put(q, self.masks([q])[q.req_id]):  # masks(): what benchmarks time
                    self._tracked.pop(q.req_id, None)  # its request failed at the deadline
                    return
        finally:
            step.done.set()

    def _late(self, q: GrammarQuery) -> GrammarError:
        return GrammarError(
            f"{q.spec.source}: the grammar's mask took longer than {self.mask_timeout_s} s (grammar_mask_timeout_s)"
        )

    def _compiling(self, q: GrammarQuery, stuck: GrammarQuery) -> bool:
        """q has the stuck request's grammar and it is not compiled yet: q would compile it
        again, inline, on the step's own time."""
        digest = q.spec.digest()
        with self._templates_lock:
            return digest == stuck.spec.digest() and digest not in self._templates

    def _masks_or_error(self, q: GrammarQuery) -> list[torch.Tensor] | GrammarError:
        try:
            return self._masks_for(q)
        except GrammarError as e:
            return e
        except Exception as e:  # llguidance's own failure: this request's, not the step's
            return GrammarError(f"{q.spec.source}: {type(e).__name__}: {e}")

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
        template = self._template(q.spec)
        if template.is_error():
            raise GrammarError(f"{q.spec.source}: {template.get_error()}")
        self._tracked[q.req_id] = tracked = _Tracked(template.deep_copy())
        return tracked

    def _template(self, spec: StructuredOutputs) -> LLMatcher:
        """The grammar's compiled matcher, before any token: compiled on first use, then copied."""
        digest = spec.digest()
        with self._templates_lock:
            template = self._templates.get(digest)
            if template is not None:
                self._templates.move_to_end(digest)
                return template
        template = self._compile(spec)  # outside the lock: it may take a while
        with self._templates_lock:
            self._templates[digest] = template
            while len(self._templates) > TEMPLATE_CACHE_SIZE:
                self._templates.popitem(last=False)
        return template

    def _compile(self, spec: StructuredOutputs) -> LLMatcher:
        """llguidance's compile, within its own budgets (LLParserLimits' defaults also bound each
        mask: ~200k units of lexer fuel and 50k parser items a step)."""
        from llguidance import LLMatcher

        return LLMatcher(self.lltokenizer, spec.llguidance_grammar(), log_level=0)

    @staticmethod
    def _mask(matcher: LLMatcher) -> torch.Tensor:
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        return ((words[:, None] >> _BITS) & 1).bool().flatten()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])
