"""/metrics (Prometheus) on the real server, and request traces with an in-memory exporter."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from cadenza_testkit.servers import API_KEY, PacedEngine, free_port, serve_in_thread
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL


def _scrape(server) -> dict[tuple[str, tuple], float]:
    request = urllib.request.Request(server.http + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        text = r.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": DEFAULT_MODEL, **labels}.items())))
    return samples.get(key, 0.0)


@pytest.mark.slow
def test_metrics_parse_and_move_as_requests_run(server) -> None:
    before = _scrape(server)
    client = openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY)
    messages = [{"role": "user", "content": "Name a fruit."}]
    for _ in range(2):  # the second one hits the prefix cache
        client.chat.completions.create(messages=messages, model=DEFAULT_MODEL, temperature=0, max_tokens=6)
    after = _scrape(server)
    moved = lambda name, **labels: _value(after, name, **labels) - _value(before, name, **labels)
    assert moved("cadenza:generation_tokens_total") >= 2
    assert moved("cadenza:prompt_tokens_total") > 0
    assert moved("cadenza:time_to_first_token_seconds_count") == 2
    assert moved("cadenza:e2e_request_latency_seconds_count") == 2
    assert moved("cadenza:request_queue_time_seconds_count") == 2
    assert moved("cadenza:inter_token_latency_seconds_count") >= 2
    finished = sum(moved("cadenza:request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == 2
    assert moved("cadenza:prefix_cache_queries_total") > 0 and moved("cadenza:prefix_cache_hits_total") > 0
    for gauge in ("cadenza:num_requests_running", "cadenza:num_requests_waiting", "cadenza:kv_cache_usage_perc"):
        assert (gauge, (("model_name", DEFAULT_MODEL),)) in after


def test_streamed_chat_yields_the_span_tree_with_the_callers_trace_id() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    port = free_port()
    app = build_app(PacedEngine(pace=0.01), DEFAULT_MODEL, GatewaySettings(port=port), tracer_provider=provider)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0.5,
        "stream": True,
    }
    with serve_in_thread(app, port):
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{parent_id}-01"},
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.read().decode().rstrip().endswith("data: [DONE]")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root = spans[f"chat {DEFAULT_MODEL}"]
    assert format(root.context.trace_id, "032x") == trace_id
    assert format(root.parent.span_id, "016x") == parent_id
    for child in ("queue", "prefill", "decode"):
        assert spans[child].parent.span_id == root.context.span_id
        assert spans[child].context.trace_id == root.context.trace_id
    assert spans["queue"].end_time <= spans["decode"].start_time <= spans["decode"].end_time <= root.end_time
    a = root.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == DEFAULT_MODEL
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.request.temperature"] == 0.5
    assert a["gen_ai.request.top_p"] == 1.0
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length",)
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.usage.input_tokens"] > 0
    assert a["gen_ai.server.time_to_first_token"] > 0
    assert "gen_ai.input.messages" not in a and "gen_ai.output.messages" not in a  # content is opt-in


class HandedOverEngine(PacedEngine):
    """PacedEngine whose second output says a KV hand-over happened just before it (as a
    disaggregated engine's first decode-side output does)."""

    async def generate(self, prompt, params, request_id: str, **kw):  # noqa: ANN001, ANN003, ANN201
        import time

        count = 0
        async for out in super().generate(prompt, params, request_id, **kw):
            count += 1
            if count == 2:
                out.metrics[0].kv_handoff = (time.time() - 0.002, time.time() - 0.001)
            yield out


def test_a_kv_hand_over_is_a_child_span_of_the_request() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    port = free_port()
    app = build_app(HandedOverEngine(pace=0.01), DEFAULT_MODEL, GatewaySettings(port=port), tracer_provider=provider)
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with serve_in_thread(app, port):
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
    spans = {s.name: s for s in exporter.get_finished_spans()}
    root, handoff = spans[f"chat {DEFAULT_MODEL}"], spans["kv_handoff"]
    assert handoff.parent.span_id == root.context.span_id and handoff.start_time < handoff.end_time
