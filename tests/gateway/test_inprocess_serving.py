"""`cadenza serve --in-process`: the gateway over the InProcessClient (no Ray, no actors)
answers the HTTP API and the websocket with the offline engine's greedy text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import openai
import pytest
import websockets
from cadenza_testkit.servers import API_KEY, Server, launch_server

from cadenza import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def in_process() -> Iterator[Server]:
    args = ["--in-process", "--api-key", API_KEY, "--num-blocks", "256", "--metrics-prefix", "vllm"]
    with launch_server(args, "serve_in_process.log") as srv:
        yield srv


# Every metric vLLM's published Grafana dashboard (examples/online_serving/prometheus_grafana)
# reads, as it reads it: with --metrics-prefix vllm the dashboard works unchanged.
VLLM_DASHBOARD_METRICS = [
    "vllm:e2e_request_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_count", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:time_per_output_token_seconds_bucket", "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_count", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_count", "vllm:gpu_cache_usage_perc", "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket", "vllm:request_success_total", "vllm:request_queue_time_seconds_sum",
    "vllm:request_prefill_time_seconds_sum", "vllm:request_decode_time_seconds_sum",
    "vllm:request_max_num_generation_tokens_sum",
    # and the newer names beside them
    "vllm:inter_token_latency_seconds_bucket", "vllm:request_time_per_output_token_seconds_bucket",
    "vllm:request_inference_time_seconds_bucket", "vllm:kv_cache_usage_perc",
    "vllm:iteration_tokens_total_bucket", "vllm:iteration_tokens_total_sum", "vllm:iteration_tokens_total_count",
]  # fmt: skip


@pytest.mark.slow
def test_with_the_vllm_prefix_every_dashboard_metric_is_exported(in_process: Server) -> None:
    import urllib.request

    client = openai.OpenAI(base_url=in_process.http + "/v1", api_key=API_KEY)
    client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8)
    request = urllib.request.Request(in_process.http + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        text = r.read().decode()
    exported = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    assert set(VLLM_DASHBOARD_METRICS) - exported == set()
    assert not any(name.startswith("cadenza:") for name in exported)


@pytest.mark.slow
def test_http_chat_equals_the_engine_and_no_worker_runs(in_process: Server, smollm) -> None:
    expected = smollm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    client = openai.OpenAI(base_url=in_process.http + "/v1", api_key=API_KEY)
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
    assert whole.choices[0].message.content == expected
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected
    stats = in_process.get("/stats")["engine"]
    assert stats["num_workers"] == 0 and stats["worker_pids"] == []
    assert stats["engine"]["kv_cache"]["num_free_blocks"] == 256


@pytest.mark.slow
def test_websocket_response_equals_the_engine(in_process: Server, smollm) -> None:
    expected = smollm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0].text
    create = {"type": "response.create", "model": MODEL, "input": QUESTION, "temperature": 0, "max_output_tokens": 12}

    async def run() -> tuple[str, str]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with websockets.connect(in_process.ws, additional_headers=headers) as ws:
            await ws.send(json.dumps(create))
            text = ""
            while True:
                event = json.loads(await ws.recv())
                if event["type"] == "response.output_text.delta":
                    text += event["delta"]
                if event["type"] in ("response.completed", "response.failed", "error"):
                    return text, event["type"]

    text, last = asyncio.run(run())
    assert last == "response.completed"
    assert text == expected
