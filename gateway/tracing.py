"""OpenTelemetry traces: one span per request from the gateway, with children for queueing,
prefill and decode, and the GenAI semantic-convention attributes.

Off by default. The standard variables turn it on: OTEL_TRACES_EXPORTER=console|otlp
(otlp needs `opentelemetry-exporter-otlp`), OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_*.
An incoming W3C `traceparent` makes the request span its child. Prompt and output text are
recorded only with OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"


def provider_from_env() -> trace.TracerProvider | None:
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
    if exporter_name in ("", "none"):
        return None
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError("OTEL_TRACES_EXPORTER=otlp needs: pip install opentelemetry-exporter-otlp") from None
        exporter = OTLPSpanExporter()
    else:
        raise ValueError(f"OTEL_TRACES_EXPORTER={exporter_name!r}: supported are console, otlp, none")
    provider = TracerProvider()  # the Resource reads OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def capture_content() -> bool:
    return os.environ.get(CAPTURE_CONTENT_ENV, "").strip().lower() in ("1", "true", "yes")


class Tracing:
    def __init__(self, provider: trace.TracerProvider | None) -> None:
        self.tracer = provider.get_tracer("cadenza.gateway") if provider else None
        self.capture = capture_content()

    def request(self, operation: str, model: str, headers: Mapping[str, str], params: Any) -> RequestSpan:
        return RequestSpan(self, operation, model, headers, params)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class RequestSpan:
    """The request span, started at arrival; children are recorded with their real times at the end."""

    def __init__(self, tracing: Tracing, operation: str, model: str, headers: Mapping[str, str], params: Any) -> None:
        self.tracing = tracing
        self.span: trace.Span | None = None
        if tracing.tracer is None:
            return
        self.span = tracing.tracer.start_span(
            f"{operation} {model}",
            context=propagate.extract(dict(headers)),
            kind=trace.SpanKind.SERVER,
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "cadenza",
                "gen_ai.request.model": model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
            },
        )

    def messages(self, messages: list[dict[str, str]]) -> None:
        if self.span is not None and self.tracing.capture:
            self.span.set_attribute("gen_ai.input.messages", json.dumps(messages))

    def finish(
        self,
        response_id: str,
        model: str,
        finish_reasons: list[str],
        usage: tuple[int, int],
        times: tuple[float, float | None, float | None, float],
        output_text: str | None = None,
        kv_handoff: tuple[float, float] | None = None,
    ) -> None:
        """times: (arrival, queue_time, first_token_at, finished_at), wall-clock seconds;
        kv_handoff: the window of a disaggregated request's KV hand-over (a child span)."""
        if self.span is None:
            return
        arrival, queue_time, first_token, finished = times
        ttft = None if first_token is None else first_token - arrival
        self.span.set_attributes(
            {
                "gen_ai.response.id": response_id,
                "gen_ai.response.model": model,
                "gen_ai.response.finish_reasons": finish_reasons,
                "gen_ai.usage.input_tokens": usage[0],
                "gen_ai.usage.output_tokens": usage[1],
                **({"gen_ai.server.time_to_first_token": ttft} if ttft is not None else {}),
            }
        )
        if output_text is not None and self.tracing.capture:
            self.span.set_attribute(
                "gen_ai.output.messages", json.dumps([{"role": "assistant", "content": output_text}])
            )
        scheduled = arrival + (queue_time or 0.0)
        context = trace.set_span_in_context(self.span)
        phases = [("queue", arrival, scheduled), ("prefill", scheduled, first_token or finished)]
        if first_token is not None:
            phases.append(("decode", first_token, finished))
        if kv_handoff is not None:
            phases.append(("kv_handoff", *kv_handoff))
        for name, start, end in phases:
            child = self.tracing.tracer.start_span(name, context=context, start_time=_ns(start))
            child.end(end_time=_ns(max(end, start)))
        self.span.end(end_time=_ns(finished))

    def fail(self, error: BaseException) -> None:
        if self.span is not None:
            self.span.record_exception(error)
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, str(error)))
            self.span.end()
