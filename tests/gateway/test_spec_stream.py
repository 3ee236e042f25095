"""Speculative decoding seen by clients: accepted drafts in websocket extras, OpenAI usage
fields and Prometheus counters on the shared (speculating) server, and stream pacing."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from collections.abc import Iterator

import openai
import pytest
import websockets
from cadenza_testkit.servers import API_KEY, SPECULATIVE_CONFIG, free_port, serve_in_thread
from openai.types.responses.responses_server_event import ResponsesServerEvent
from prometheus_client.parser import text_string_to_metric_families
from pydantic import TypeAdapter

from cadenza import AsyncLLM, SamplingParams
from cadenza.gateway.app import build_app
from cadenza.gateway.settings import GatewaySettings
from cadenza.models.loader import DEFAULT_MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVER_EVENT = TypeAdapter(ResponsesServerEvent)
FINISHED = ("response.completed", "response.incomplete")  # incomplete: max_output_tokens reached
TERMINAL = (*FINISHED, "response.failed", "error")
# Input-grounded: the reply copies the prompt, so prompt-lookup drafts get accepted.
SENTENCE = "the quick brown fox jumps over the lazy dog."
PROMPT = f"Repeat exactly: {SENTENCE} {SENTENCE}"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def expected(smollm) -> str:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return smollm.chat([{"role": "user", "content": PROMPT}], params)[0].outputs[0].text


async def _response_events(url: str) -> list[dict]:
    """One greedy response over a bare websocket; every event checked against the SDK's models."""
    create = {"type": "response.create", "input": PROMPT, "temperature": 0, "max_output_tokens": MAX_TOKENS}
    async with websockets.connect(url, additional_headers=AUTH) as ws:
        await ws.send(json.dumps(create))
        events = []
        while not events or events[-1]["type"] not in TERMINAL:
            events.append(json.loads(await ws.recv()))
            SERVER_EVENT.validate_python(events[-1])
    return events


def _deltas(events: list[dict]) -> list[dict]:
    return [ev for ev in events if ev["type"] == "response.output_text.delta"]


@pytest.mark.slow
def test_ws_deltas_and_the_completed_response_report_accepted_drafts(server, expected: str) -> None:
    events = asyncio.run(_response_events(server.ws))
    assert events[-1]["type"] in FINISHED, events[-1]
    deltas = _deltas(events)
    assert "".join(d["delta"] for d in deltas) == expected  # speculation leaves greedy text as it is
    accepted = [d["cadenza"]["accepted_tokens"] for d in deltas]
    assert max(accepted) > 0 and max(len(d["cadenza"]["token_ids"]) for d in deltas) > 1
    extras = events[-1]["response"]["cadenza"]
    assert extras["num_accepted_tokens"] == sum(accepted)
    assert 0 < extras["num_drafts"] <= extras["num_draft_tokens"]
    assert extras["num_draft_tokens"] <= extras["num_drafts"] * SPECULATIVE_CONFIG["num_speculative_tokens"]
    assert extras["acceptance_rate"] == pytest.approx(sum(accepted) / extras["num_draft_tokens"])


@pytest.mark.slow
def test_http_usage_counts_accepted_and_rejected_predictions(server, expected: str) -> None:
    client = openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY)
    request = dict(model=DEFAULT_MODEL, messages=[{"role": "user", "content": PROMPT}], temperature=0)
    whole = client.chat.completions.create(**request, max_tokens=MAX_TOKENS)
    assert whole.choices[0].message.content == expected
    details = whole.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens >= 0
    chunks = list(
        client.chat.completions.create(
            **request, max_tokens=MAX_TOKENS, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[-1].usage.completion_tokens_details == details  # same drafts: n-gram lookup is deterministic
    prompt = f"{SENTENCE} {SENTENCE} {SENTENCE}"
    completion = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, temperature=0, max_tokens=16)
    assert completion.usage.completion_tokens_details.accepted_prediction_tokens > 0


@pytest.mark.slow
def test_metrics_export_spec_decode_counters(server) -> None:
    client = openai.OpenAI(base_url=server.http + "/v1", api_key=API_KEY)
    client.completions.create(model=DEFAULT_MODEL, prompt=f"{SENTENCE} {SENTENCE}", temperature=0, max_tokens=8)
    request = urllib.request.Request(server.http + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    value = lambda name: families[name].samples[0].value  # noqa: E731
    drafts, draft_tokens = value("cadenza:spec_decode_num_drafts"), value("cadenza:spec_decode_num_draft_tokens")
    accepted = value("cadenza:spec_decode_num_accepted_tokens")
    assert families["cadenza:spec_decode_num_drafts"].type == "counter"
    assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens
    by_position = families["cadenza:spec_decode_num_accepted_tokens_per_pos"].samples
    per_pos = {s.labels["position"]: s.value for s in by_position}
    assert set(per_pos) == {str(j) for j in range(SPECULATIVE_CONFIG["num_speculative_tokens"])}
    assert sum(per_pos.values()) == accepted and per_pos["0"] >= per_pos["1"]


@pytest.fixture(scope="module")
def paced_server(ray_cluster) -> Iterator[str]:
    """An in-process speculating engine behind a gateway with stream_pacing on."""
    engine = AsyncLLM(DEFAULT_MODEL, num_blocks=256, speculative_config=SPECULATIVE_CONFIG)
    settings = GatewaySettings(port=free_port(), api_key=API_KEY, stream_pacing=True)
    try:
        with serve_in_thread(build_app(engine, DEFAULT_MODEL, settings), settings.port):
            yield f"ws://127.0.0.1:{settings.port}/v1/responses"
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_stream_pacing_sends_one_token_per_delta_event(paced_server: str, expected: str) -> None:
    events = asyncio.run(_response_events(paced_server))
    assert events[-1]["type"] in FINISHED, events[-1]
    deltas = _deltas(events)
    assert "".join(d["delta"] for d in deltas) == expected
    assert all(len(d["cadenza"]["token_ids"]) == 1 for d in deltas)
    accepted = [d["cadenza"]["accepted_tokens"] for d in deltas]
    assert set(accepted) <= {0, 1} and sum(accepted) == events[-1]["response"]["cadenza"]["num_accepted_tokens"] > 0
