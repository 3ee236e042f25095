"""One request's observation: Prometheus latencies and token counts, its trace span and its
request-log line (logger cadenza.requests, at INFO), fed the same deltas the client gets, so
both paths (HTTP and websocket) report alike."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from cadenza.gateway.metrics import Metrics, RequestTimes
from cadenza.gateway.tracing import Tracing
from cadenza.outputs import RequestOutput

request_log = logging.getLogger("cadenza.requests")


class Observation:
    def __init__(
        self, metrics: Metrics, tracing: Tracing, operation: str, headers: Mapping[str, str], params: Any
    ) -> None:
        self.arrival = time.time()
        self.recorder = metrics.request()
        self.model = metrics.model_name
        self.span = tracing.request(operation, self.model, headers, params)
        self.first_token_at: float | None = None
        self.queue_time: float | None = None
        self.output_tokens = 0
        self.kv_handoff: tuple[float, float] | None = None  # disaggregation's hand-over window
        # Per sequence index: its speculative (drafts, draft tokens, accepted) so far.
        self.spec: dict[int, tuple[int, int, int]] = {}
        self.done = False

    def delta(self, out: RequestOutput) -> None:
        now = time.time()
        count = sum(len(c.token_ids) for c in out.outputs)
        if count and self.first_token_at is None:
            self.first_token_at = now
        self.output_tokens += count
        self.recorder.tokens(count, now, self.arrival)
        self.kv_handoff = next((m.kv_handoff for m in out.metrics if m.kv_handoff), self.kv_handoff)
        queue_times = [m.queue_time for m in out.metrics if m.queue_time is not None]
        self.queue_time = queue_times[0] if queue_times else self.queue_time
        for completion, m in zip(out.outputs, out.metrics):  # cumulative counts: keep the latest
            self.spec[completion.index] = (m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens)

    def acceptance(self) -> dict[str, Any]:
        """Speculative decoding over the request's sequences: drafts verified and accepted."""
        drafts, draft_tokens, accepted = (sum(s[i] for s in self.spec.values()) for i in range(3))
        return {
            "num_drafts": drafts,
            "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        }

    def finish(self, response_id: str, reasons: list[str], prompt_tokens: int, text: str | None = None) -> None:
        if self.done:
            return
        self.done = True
        now = time.time()
        times = RequestTimes(self.arrival, self.queue_time, self.first_token_at, now)
        self.recorder.finish(reasons[0] if reasons else "abort", prompt_tokens, times, self.output_tokens)
        times = (self.arrival, self.queue_time, self.first_token_at, now)
        usage = (prompt_tokens, self.output_tokens)
        self.span.finish(response_id, self.model, reasons, usage, times, text, self.kv_handoff)
        if request_log.isEnabledFor(logging.INFO):
            ttft = None if self.first_token_at is None else round(self.first_token_at - self.arrival, 3)
            finish, total = ",".join(reasons) or "abort", round(now - self.arrival, 3)
            fields = dict(request_id=response_id, prompt_tokens=prompt_tokens, output_tokens=self.output_tokens,
                          ttft_s=ttft, total_s=total, finish_reason=finish)  # fmt: skip
            request_log.info(
                "%s: %d prompt tokens, %d output tokens, ttft %s, total %.3fs, finish %s",
                response_id, prompt_tokens, self.output_tokens, "-" if ttft is None else f"{ttft:.3f}s", total, finish,
                extra={"fields": fields},
            )  # fmt: skip

    def fail(self, error: BaseException) -> None:
        if not self.done:
            self.done = True
            times = RequestTimes(self.arrival, self.queue_time, self.first_token_at, time.time())
            self.recorder.finish("error", 0, times)
            self.span.fail(error)
            request_log.info("request failed after %.3fs: %s", time.time() - self.arrival, type(error).__name__)
