"""Turns engine deltas into text: incremental detokenization, stop strings, logprobs."""

from __future__ import annotations

import time

from cadenza.messages import EngineOutput, TokenLogprobs
from cadenza.models.detokenizer import IncrementalDetokenizer
from cadenza.models.tokenizer import Tokenizer
from cadenza.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics
from cadenza.sampling_params import SamplingParams


class SequenceState:
    """One output sequence (one of a request's n) as the client sees it."""

    def __init__(self, index: int, tokenizer: Tokenizer | None, prompt_ids: list[int], params: SamplingParams) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.params = params
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens) if tokenizer else None
        self.token_ids: list[int] = []
        self.text = ""
        self.emitted = 0  # chars of text already streamed
        self.logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.prompt_logprobs: list[PositionLogprobs | None] = [None]
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.metrics = RequestMetrics(arrival_time=time.time())

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def process(self, out: EngineOutput) -> bool:
        """Apply one delta. True when a stop string ended the sequence (the engine must abort it)."""
        if self.finished:
            return False
        self._record_time(out)
        self._record_spec(out)
        self.num_cached_tokens = out.num_cached_tokens
        self.token_ids += out.new_token_ids
        self._add_logprobs(out.new_logprobs)
        self.prompt_logprobs += [self._position(lp) for lp in out.new_prompt_logprobs]
        stopped = self._add_text(out.new_token_ids, final=out.finish_reason is not None)
        if not stopped and out.finish_reason:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        return stopped

    def _record_time(self, out: EngineOutput) -> None:
        now = time.time()
        if out.queue_time is not None:
            self.metrics.queue_time = out.queue_time
        if out.new_token_ids:
            self.metrics.first_token_time = self.metrics.first_token_time or now
            self.metrics.last_token_time = now
        if out.finish_reason:
            self.metrics.finished_time = now

    def _record_spec(self, out: EngineOutput) -> None:
        m = self.metrics
        m.num_drafts += out.num_draft_tokens > 0
        m.num_draft_tokens += out.num_draft_tokens
        m.num_accepted_tokens += out.num_accepted_tokens

    def _add_text(self, new_ids: list[int], final: bool) -> bool:
        if self.detok is None:
            return False
        before = len(self.text)
        self.text += self.detok.add(new_ids)
        if final:
            self.text += self.detok.flush()
        return self._check_stop_strings(before)

    def _check_stop_strings(self, before: int) -> bool:
        """The stop string that appears earliest in the text, ending in the new text (it may
        start in older text). None counts before min_tokens tokens exist, as in vLLM."""
        if not self.params.stop or len(self.token_ids) < self.params.min_tokens:
            return False
        found = [(at, stop) for stop in self.params.stop if (at := self._find(stop, before)) >= 0]
        if not found:
            return False
        at, stop = min(found, key=lambda f: (f[0], -len(f[1])))
        end = at + len(stop) if self.params.include_stop_str_in_output else at
        self.text = self.text[:end]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def _find(self, stop: str, before: int) -> int:
        return self.text.find(stop, max(before - len(stop) + 1, 0))

    def visible_delta(self) -> str:
        """New text safe to show while streaming: held back while it could still begin a stop string."""
        hold = 0 if self.finished else max((len(s) - 1 for s in self.params.stop), default=0)
        end = max(len(self.text) - hold, self.emitted)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def _add_logprobs(self, new: list[TokenLogprobs]) -> None:
        if self.logprobs is None:
            return
        for lp in new:
            self.logprobs.append(self._position(lp))
            self.cumulative_logprob += lp.logprobs[0]

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        position = {}
        for rank_in_top, (token, value) in enumerate(zip(lp.token_ids, lp.logprobs)):
            rank = lp.rank if rank_in_top == 0 else rank_in_top
            decoded = self.tokenizer.token_text(token) if self.tokenizer else None
            position.setdefault(token, Logprob(value, rank, decoded))
        return position

    def completion(self) -> CompletionOutput:
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
            self.metrics.num_accepted_tokens,
        )
