"""What one request's deltas add up to, kept alike by both stream loops (the HTTP API's in
openai_http and the websocket's ResponseRun): each sequence's text and finish reason, the
cached prompt tokens, and the Observation (metrics and trace span) fed every delta the client
gets, so the usage, the metrics and the span of a request agree whichever path served it.

Wire formats (SSE chunks, logprob entries, `response.*` events) stay with their API."""

from __future__ import annotations

from cadenza.gateway.observe import Observation
from cadenza.outputs import CompletionOutput, RequestOutput


class StreamTally:
    def __init__(self, observation: Observation) -> None:
        self.observation = observation
        self.texts: dict[int, str] = {}  # per sequence index
        self.reasons: dict[int, str] = {}  # per sequence index, once it finished
        self.cached_tokens = 0

    def add(self, delta: RequestOutput) -> CompletionOutput:
        """Counts one delta and returns its completion (the engine sends one sequence's step per
        delta; the loop renders it)."""
        self.observation.delta(delta)
        self.cached_tokens = delta.num_cached_tokens  # the same on every delta of a request
        for out in delta.outputs:
            self.texts[out.index] = self.texts.get(out.index, "") + out.text
            if out.finish_reason:
                self.reasons[out.index] = out.finish_reason
        return delta.outputs[0]

    @property
    def text(self) -> str:
        """The first sequence's text: the websocket's only one, and the one the span records."""
        return self.texts.get(0, "")

    @property
    def completion_tokens(self) -> int:
        return self.observation.output_tokens

    def finish_reasons(self) -> list[str]:
        return [self.reasons[i] for i in sorted(self.reasons)]

    def finish(self, request_id: str, prompt_tokens: int, reasons: list[str] | None = None) -> None:
        """Records the end; reasons default to the sequences' own (a cancel or a steer says its own)."""
        reasons = self.finish_reasons() if reasons is None else reasons
        self.observation.finish(request_id, reasons, prompt_tokens, self.text)

    def fail(self, error: BaseException) -> None:
        self.observation.fail(error)
